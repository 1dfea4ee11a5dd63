"""Output-discarding recompute (``checkpoint_without_output`` inside ``discard_outputs``): what it
must guarantee.

* What it saves: the ops after the function keep nothing of its output, and the function keeps
  only its inputs: on our Llama layer ``norm`` drops both norm outputs and their fp32 1/rms,
  ``mlp_act`` drops SwiGLU's output, to the byte.
* It changes memory, never numbers: gradients bit-identical to running plainly, with dropout
  inside the discarded function, whatever else reads the output (a residual, a second consumer,
  a view), for ``torch.autograd.grad``, twice with ``retain_graph``, nested inside full recompute,
  at TP 2 + SP and with distributed saved inputs; double backward is one clear error.
* Other saved-tensor hooks still see everything the block keeps (the recorder measures through it).
* torch's FLOP counter and memory tracker (``FlopCounterMode``, ``MemTracker``: both hook every
  module's inputs) run through it with the gradients they give without recompute; what it reruns
  is counted like any other recompute (tests/test_recompute_flops.py).

On XLA (the optimization barrier before the rerun): tests_xla/test_recompute_xla.py. Under
torch.compile (no new graph break): tests/test_compile.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.flop_counter import FlopCounterMode

import neuron_ckpt as nc
from neuron_ckpt.memory import SavedTensorRecorder
from neuron_ckpt.models.llama import LlamaDecoderLayer, LlamaOptions
from neuron_ckpt.models.llama_args import LlamaArgs
from neuron_ckpt.models.rotary import RotaryEmbedding
from neuron_ckpt.recompute import (
    RecomputeConfig,
    apply_recompute,
    checkpoint,
    checkpoint_without_output,
    discard_outputs,
    remove_recompute,
    run_layers,
)


class NormWithDropout(torch.nn.Module):
    """A function to discard that draws random numbers: its rerun must draw the same."""

    def __init__(self, h: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(h)

    def forward(self, x):
        return F.dropout(self.norm(x), 0.3, self.training)


class Block(torch.nn.Module):
    """``norm -> linear`` where the norm's output is also a residual, a second consumer's input
    and seen through a view."""

    def __init__(self, h: int = 16, discard: bool = True):
        super().__init__()
        self.norm, self.proj, self.gate = NormWithDropout(h), torch.nn.Linear(h, h), torch.nn.Linear(h, 1)
        self.discard = discard

    def body(self, x):
        y = checkpoint_without_output(self.norm, x) if self.discard else self.norm(x)
        flat = y.reshape(-1, y.shape[-1])  # a view: kept as a view of the recomputed output
        return x + y + self.proj(y) * torch.sigmoid(self.gate(flat)).view(*y.shape[:-1], 1)

    def forward(self, x):
        with discard_outputs():
            return self.body(x)


def _grads(block: Block, x: torch.Tensor, seed: int = 3, **backward):
    torch.manual_seed(seed)
    out = block(x)
    torch.manual_seed(99)  # the surrounding stream moves on: the rerun must not depend on it
    grads = torch.autograd.grad(out.square().sum(), [x, *block.parameters()], **backward)
    return out.detach(), grads


def _x():
    return torch.randn(6, 2, 16, generator=torch.Generator().manual_seed(0)).requires_grad_()


def _pair():
    torch.manual_seed(0)
    plain = Block(discard=False)
    discarding = Block()
    discarding.load_state_dict(plain.state_dict())
    return plain, discarding


def _identical(a, b, label=""):
    assert torch.equal(a[0], b[0]), label
    for i, (u, v) in enumerate(zip(a[1], b[1])):
        assert torch.equal(u, v), f"{label}: gradient {i} differs"


def test_bit_identical_with_dropout_inside_residual_views_and_two_consumers():
    plain, discarding = _pair()
    x = _x()
    reference = _grads(plain, x)
    _identical(reference, _grads(discarding, x), "autograd.grad")
    assert not torch.equal(reference[0], _grads(plain, x, seed=4)[0])  # the dropout draws: a real check


def test_backward_twice_with_retain_graph_gives_the_same_gradients_and_double_backward_is_refused():
    plain, discarding = _pair()
    x = _x()
    torch.manual_seed(3)
    out = discarding(x).square().sum()
    first = torch.autograd.grad(out, [x, *discarding.parameters()], retain_graph=True)
    second = torch.autograd.grad(out, [x, *discarding.parameters()])
    _identical((out, first), (out, second), "retain_graph")
    _identical(_grads(plain, x), (_grads(discarding, x)[0], first), "against plain")
    torch.manual_seed(3)
    with pytest.raises(RuntimeError, match="once-differentiable"):
        torch.autograd.grad(discarding(x).square().sum(), x, create_graph=True)


def test_a_parameters_gradient_hook_runs_once_per_backward():
    # A hook completing a gradient (sequence parallel sums a norm weight's over the TP group) would
    # be applied twice if it ran in the rerun's own backward too: here it doubles the gradient.
    plain, discarding = _pair()
    calls = []
    for block in (plain, discarding):
        block.norm.norm.weight.register_hook(lambda g: calls.append(1) or g * 2)
    x = _x()
    reference = _grads(plain, x)
    assert len(calls) == 1
    _identical(reference, _grads(discarding, x), "hooked")
    assert len(calls) == 2


@pytest.mark.parametrize("outer", ["reentrant", "non-reentrant", "torch"])
def test_nested_inside_full_recompute_gives_the_same_gradients(outer):
    plain, discarding = _pair()
    x = _x()
    if outer == "torch":
        wrapped = lambda x: torch.utils.checkpoint.checkpoint(discarding, x, use_reentrant=False)  # noqa: E731
    else:
        wrapped = lambda x: checkpoint(discarding, x, use_reentrant=outer == "reentrant")  # noqa: E731
    torch.manual_seed(3)
    out = wrapped(x).square().sum()
    torch.manual_seed(99)
    out.backward()
    got = (out.detach(), [x.grad, *(p.grad for p in discarding.parameters())])
    torch.manual_seed(3)
    reference = plain(x).square().sum()
    torch.manual_seed(99)
    _identical((reference.detach(), torch.autograd.grad(reference, [x, *plain.parameters()])), got, outer)


def test_it_keeps_only_the_inputs_and_other_hooks_see_them():
    plain, discarding = _pair()
    x = _x()
    kept = {}
    for name, block in (("plain", plain), ("discarding", discarding)):
        with SavedTensorRecorder(exclude_modules=[block], exclude_tensors=[x]) as rec:
            out = block(x)  # noqa: F841  the graph alive at exit: what backward finds
        kept[name] = rec.total_bytes
    # Gone: the norm's mean and 1/std ([6, 2, 1] fp32 each), the dropout's mask and its output y
    # ([6, 2, 16] fp32 each; y kept by proj and, as a view, by gate). Both still keep what the
    # ops after it keep of their own (proj's output, the sigmoid), seen through the block's hooks.
    assert kept["plain"] - kept["discarding"] == 2 * (6 * 2 * 4) + 2 * (6 * 2 * 16 * 4)
    assert kept["discarding"] == 6 * 2 * 16 * 4 + 12 * 4


def test_outside_a_block_it_is_an_error_and_without_grad_it_just_runs():
    norm = torch.nn.LayerNorm(4)
    with pytest.raises(RuntimeError, match="discard_outputs"):
        checkpoint_without_output(norm, torch.randn(2, 4))
    with torch.no_grad():
        assert torch.equal(checkpoint_without_output(norm, torch.ones(2, 4)), norm(torch.ones(2, 4)))


# ---------------------------------------------------------------------------------------------
# Our Llama layers: what `norm` and `mlp_act` drop, to the byte; bit-identical at TP 2 + SP.

H, F_, HEADS, S = 64, 96, 4, 32


def _llama_layers(modules, t: int, sp: bool, dropout: float = 0.0, dtype=torch.float32, distribute=False):
    state = nc.initialize_model_parallel(t)
    args = LlamaArgs(vocab_size=128, hidden_size=H, intermediate_size=F_, num_hidden_layers=2,
                     num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=S,
                     attention_dropout=dropout)  # fmt: skip
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(LlamaDecoderLayer(args, LlamaOptions(sp, "explicit", dtype, state)) for _ in range(2))
    if modules:
        apply_recompute(layers, RecomputeConfig("selective", modules=modules, distribute_saved_activations=distribute))
    cos, sin = RotaryEmbedding(args)(S, dtype, torch.device("cpu"))
    x = torch.randn(S, 2, H, generator=torch.Generator().manual_seed(1)).to(dtype)
    if sp:
        x = x.chunk(t)[state.tp_rank].clone()
    return layers, x.requires_grad_(), (cos, sin)


def _kept_bytes(modules) -> int:
    layers, x, rope = _llama_layers(modules, 1, False, dtype=torch.bfloat16)
    with SavedTensorRecorder(exclude_modules=[layers], exclude_tensors=[x, *rope]) as rec:
        out = run_layers(layers, x, *rope)  # noqa: F841  the graph alive at exit: what backward finds
    return rec.total_bytes


def _kept_sizes() -> dict:
    subsets = [("core_attn",), ("core_attn", "norm"), ("core_attn", "mlp_act"), ("core_attn", "mlp_act", "norm")]
    return {m: _kept_bytes(m) for m in subsets}


def test_llama_norm_and_mlp_act_drop_their_outputs_to_the_byte(world):
    sbh, sbf = S * 2 * H, S * 2 * F_
    norm = 2 * (2 * sbh + 4 * S * 2)  # per layer: both norm outputs (bf16) and their fp32 1/rms
    act = 2 * sbf  # SwiGLU's output (bf16), which the down projection keeps
    sizes = world(1).run(_kept_sizes)[0]
    base = sizes[("core_attn",)]
    assert base - sizes[("core_attn", "norm")] == 2 * norm  # two layers
    assert base - sizes[("core_attn", "mlp_act")] == 2 * act
    assert base - sizes[("core_attn", "mlp_act", "norm")] == 2 * (norm + act)


def _llama_step(modules, t: int, sp: bool, distribute: bool = False):
    layers, x, rope = _llama_layers(modules, t, sp, dropout=0.2, distribute=distribute)
    nc.model_parallel_manual_seed(5)
    out = run_layers(layers, x, *rope)
    loss = out.square().sum()
    loss.backward()
    grads = [x.grad] + [p.grad for p in layers.parameters()]
    remove_recompute(layers)
    return loss.detach(), grads


def _llama_variants(t: int, sp: bool, distribute: bool):
    subsets = [("norm",), ("mlp_act",), ("core_attn", "mlp_act", "norm"), ("core_attn", "mlp", "norm")]
    return _llama_step((), t, sp), {m: _llama_step(m, t, sp, distribute) for m in subsets}


@pytest.mark.parametrize("t, sp, distribute", [(1, False, False), (2, True, False), (2, False, True)])
def test_llama_bit_identical_with_attention_dropout(world, t, sp, distribute):
    for rank, (reference, variants) in enumerate(world(t).run(_llama_variants, t, sp, distribute)):
        for modules, got in variants.items():
            _identical(reference, got, f"rank {rank} {modules}")


def _tracked_step(modules, tracker: str):
    layers, x, rope = _llama_layers(modules, 1, False)
    if tracker == "memory":
        context = MemTracker()
        context.track_external(layers)
    else:
        context = FlopCounterMode(display=False) if tracker == "flops" else contextlib.nullcontext()
    with context:
        run_layers(layers, x, *rope).square().sum().backward()
    return torch.tensor(0.0), [x.grad] + [p.grad for p in layers.parameters()]


def _tracked() -> dict:
    out = {((), tracker): _tracked_step((), tracker) for tracker in ("none", "flops", "memory")}
    for modules in [("core_attn", "mlp_act", "norm"), ("mlp", "norm")]:  # the norm's note: a checkpoint's input
        out.update({(modules, tracker): _tracked_step(modules, tracker) for tracker in ("flops", "memory")})
    return out


def test_under_torchs_flop_counter_and_memory_tracker_gradients_are_unchanged(world):
    # Both trackers hook the inputs of every module, the rerun's too: a hook on a leaf used to meet
    # the rerun's autograd.grad ("A leaf node was passed to _will_engine_execute_node ...").
    got = world(1).run(_tracked)[0]
    for (modules, tracker), step in got.items():
        _identical(got[((), tracker)], step, f"{modules} under {tracker}")
    _identical(got[((), "none")], got[((), "memory")], "the memory tracker alone")


class _Gate(torch.nn.Module):
    """transformers' experts' ``_apply_gate``: views of its input, then a submodule."""

    def __init__(self):
        super().__init__()
        self.act = torch.nn.SiLU()

    def forward(self, x):
        gate, up = x.chunk(2, dim=-1)
        return self.act(gate) * up


@pytest.mark.parametrize("tracker", ["flops", "memory"])
def test_a_function_that_views_its_input_and_calls_a_module_runs_under_the_trackers(tracker):
    torch.manual_seed(0)
    proj, gate, down = torch.nn.Linear(16, 32), _Gate(), torch.nn.Linear(16, 16)
    x = _x()
    grads = []
    for discard in (False, True):
        if tracker == "memory":
            context = MemTracker()
            context.track_external(proj, gate, down)
        else:
            context = FlopCounterMode(display=False)
        with context:
            with discard_outputs():
                h = proj(x)
                out = down(checkpoint_without_output(gate, h) if discard else gate(h))
            out.square().sum().backward()
        grads.append([t.grad.clone() for t in (x, *proj.parameters(), *down.parameters())])
        for t in (x, *proj.parameters(), *down.parameters()):
            t.grad = None
    _identical((torch.tensor(0.0), grads[0]), (torch.tensor(0.0), grads[1]), tracker)
