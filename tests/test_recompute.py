"""Activation recomputation: what it must guarantee.

* Recompute changes memory, never numbers: with dropout on, tensor + sequence parallel, the loss
  and every gradient are bit-identical to no recompute, for every granularity and method, for
  both checkpoint variants, and with distributed saved inputs.
* It saves what it promises: fewer bytes kept for backward (selective < none, full < selective),
  and each layer's forward runs as often as the method says.
* Every invalid configuration fails before any training work, naming the field.
* Recompute never changes state_dict keys.
* One way in: models take no recompute argument; ``apply_recompute`` applies it to the built
  model (its numerics: the tests above, and tests/test_llama.py against ``transformers``).

On XLA (barrier, dropout replay, non-reentrant refused): tests_xla/test_recompute_xla.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import neuron_ckpt as nc
from neuron_ckpt.distributed.random import get_rng_tracker
from neuron_ckpt.parallel import ColumnParallelLinear, CoreAttention, QKVParallelLinear, RMSNorm, RowParallelLinear
from neuron_ckpt.recompute import (
    Recompute,
    RecomputeConfig,
    apply_recompute,
    checkpoint,
    remove_recompute,
    run_layers,
    unwrapped,
)

from .helpers import counted_forwards

# ---------------------------------------------------------------------------------------------
# A small transformer-ish stack built from the parallel layers ([s, b, h], sequence first).


class MLP(torch.nn.Module):
    def __init__(self, h: int, sp: bool, p: float):
        super().__init__()
        self.fc1 = ColumnParallelLinear(h, 4 * h, sequence_parallel=sp)
        self.act_fn = torch.nn.GELU()
        self.fc2 = RowParallelLinear(4 * h, h, sequence_parallel=sp)
        self.p = p

    def forward(self, x):
        y = self.fc1(x)
        with get_rng_tracker().fork():  # inside the TP region: features differ per rank
            y = F.dropout(y, self.p, self.training)
        return self.fc2(self.act_fn(y))  # fc2 keeps act_fn's output: mlp_act discards it


class Layer(torch.nn.Module):
    def __init__(self, h: int, heads: int, sp: bool, p: float):
        super().__init__()
        t = nc.get_parallel_state().tp_size
        self.input_norm = RMSNorm(h, sequence_parallel=sp)
        self.qkv = QKVParallelLinear(h, heads, sequence_parallel=sp)
        self.core_attn = CoreAttention(heads // t, heads // t, h // heads, attention_dropout=p)
        self.proj = RowParallelLinear(h, h, sequence_parallel=sp)
        self.post_norm = RMSNorm(h, sequence_parallel=sp)
        self.mlp = MLP(h, sp, p)
        self.p, self.sp = p, sp

    def _dropout(self, y):
        # Replicated activations draw from the default stream; a sequence-parallel chunk is
        # different on every rank, so it draws from the TP stream.
        with get_rng_tracker().fork() if self.sp else contextlib.nullcontext():
            return F.dropout(y, self.p, self.training)

    def forward(self, x, scale=1.0):
        q, k, v = self.qkv(self.input_norm(x))
        x = x + self._dropout(self.proj(self.core_attn(q, k, v)))
        return x + scale * self._dropout(self.mlp(self.post_norm(x)))


class Stack(torch.nn.Module):
    def __init__(self, n: int, h: int, heads: int, sp: bool, p: float):
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer(h, heads, sp, p) for _ in range(n))

    def forward(self, x, scale=1.0):
        return run_layers(self.layers, x, scale=scale)


VARIANTS = {
    "none": RecomputeConfig(),
    "selective": RecomputeConfig(granularity="selective"),
    "selective_all": RecomputeConfig(granularity="selective", modules=["core_attn", "mlp", "norm"]),
    "selective_act": RecomputeConfig(granularity="selective", modules=["core_attn", "mlp_act"]),
    "uniform1": RecomputeConfig(granularity="full", method="uniform", num_layers=1),
    "uniform2": RecomputeConfig(granularity="full", method="uniform", num_layers=2),
    "uniform3": RecomputeConfig(granularity="full", method="uniform", num_layers=3),
    "block2": RecomputeConfig(granularity="full", method="block", num_layers=2),
}
VARIANTS.update(
    {
        f"{k}_reentrant": RecomputeConfig(**{**v.__dict__, "use_reentrant": True})
        for k, v in VARIANTS.items()
        if v.enabled
    }
)


def _input(seq: int, b: int, h: int, sp: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(seq, b, h, generator=g)
    if sp:
        x = x.chunk(nc.get_parallel_state().tp_size, 0)[nc.get_parallel_state().tp_rank]
    return x.clone().requires_grad_(True)


def _train_step(cfg: RecomputeConfig | str, t: int, sp: bool, p: float = 0.1, seed: int = 1234, seq: int = 8):
    """Loss, input grad and every parameter grad of one fwd+bwd under ``cfg``."""
    nc.initialize_model_parallel(t)
    h, heads, b = 16, 4, 2
    torch.manual_seed(0)
    model = Stack(4, h, heads, sp, p)
    if cfg == "torch_checkpoint":  # negative control: torch's own checkpoint, no tracker replay
        for layer in model.layers:
            layer.forward = lambda x, scale=1.0, _f=layer.forward: torch.utils.checkpoint.checkpoint(
                _f, x, scale=scale, use_reentrant=False
            )
    else:
        apply_recompute(model.layers, cfg, sequence_parallel=sp)
    nc.model_parallel_manual_seed(seed)
    x = _input(seq, b, h, sp)
    out = model(x, scale=0.5)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    loss = (out * w).sum()
    loss.backward()
    grads = {n: q.grad.clone() for n, q in model.named_parameters()}
    return loss.detach(), x.grad.clone(), grads


# A reentrant checkpoint returns ONE gradient per input. RMSNorm uses its input twice, and the
# layer uses it once more for the residual: without recompute autograd sums the three
# contributions in one order, a reentrant checkpointed norm sums its two first. Same numbers up to
# float rounding (associativity), not an RNG effect: the non-reentrant variant, which keeps a
# single graph, is bit-identical for the same modules.
ROUNDING_ONLY = {"selective_all_reentrant"}


def _assert_close(ref, other, label):
    for a, b in zip((ref[0], ref[1], *ref[2].values()), (other[0], other[1], *other[2].values())):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=label)


def _all_variants(t: int, sp: bool, names: list[str]):
    return {name: _train_step(VARIANTS[name] if name in VARIANTS else name, t, sp) for name in names}


def _assert_identical(ref, other, label):
    loss, xg, grads = ref
    loss2, xg2, grads2 = other
    assert torch.equal(loss, loss2), f"{label}: loss {loss} != {loss2}"
    assert torch.equal(xg, xg2), f"{label}: input grad differs"
    assert grads.keys() == grads2.keys()
    for n in grads:
        assert torch.equal(grads[n], grads2[n]), f"{label}: grad of {n} differs"


def test_bit_identical_with_dropout_tp2_sequence_parallel(world):
    names = list(VARIANTS) + ["torch_checkpoint"]
    per_rank = world(2).run(_all_variants, 2, True, names)
    for rank, results in enumerate(per_rank):
        ref = results["none"]
        for name in VARIANTS:
            if name in ROUNDING_ONLY:
                _assert_close(ref, results[name], f"rank {rank} {name}")
            else:
                _assert_identical(ref, results[name], f"rank {rank} {name}")
        # Control: torch.utils.checkpoint replays CPU/CUDA generators but not the TP stream, so
        # recomputed dropout differs and so do the gradients.
        assert not torch.equal(ref[1], results["torch_checkpoint"][1])
    # Dropout draws from the TP stream on shards, so the ranks' results differ.
    assert not torch.equal(per_rank[0]["none"][1], per_rank[1]["none"][1])


def _distributed_variants(t: int):
    base = _train_step(RecomputeConfig(), t, sp=False)
    out = {}
    for name in ("selective_all", "uniform1", "uniform2", "block2"):
        cfg = RecomputeConfig(**{**VARIANTS[name].__dict__, "distribute_saved_activations": True})
        out[name] = _train_step(cfg, t, sp=False)
    return base, out


def test_bit_identical_with_distributed_saved_activations_tp2(world):
    for rank, (base, out) in enumerate(world(2).run(_distributed_variants, 2)):
        for name, result in out.items():
            # distribute_saved_activations runs the reentrant variant
            check = _assert_close if f"{name}_reentrant" in ROUNDING_ONLY else _assert_identical
            check(base, result, f"rank {rank} distributed {name}")


def test_dropout_is_active():
    # Guards the tests above: with another seed the loss changes, so equal results are meaningful.
    assert not torch.equal(
        _single(lambda: _train_step(RecomputeConfig(), 1, False))[0],
        _single(lambda: _train_step(RecomputeConfig(), 1, False, seed=99))[0],
    )


def _single(fn):
    try:
        return fn()
    finally:
        nc.destroy_distributed()
        get_rng_tracker().reset()


# ---------------------------------------------------------------------------------------------
# Memory kept for backward and forward counts.


def _saved_bytes_and_counts(names: list[str], t: int, sp: bool, seq: int):
    nc.initialize_model_parallel(t)
    out = {}
    for name in names:
        if name.endswith("_dist"):
            cfg = RecomputeConfig(**{**VARIANTS[name[:-5]].__dict__, "distribute_saved_activations": True})
        else:
            cfg = VARIANTS[name]
        torch.manual_seed(0)
        model = Stack(4, 16, 4, sp, 0.1)
        units = apply_recompute(model.layers, cfg, sequence_parallel=sp)
        nc.model_parallel_manual_seed(1)
        x = _input(seq, 2, 16, sp)
        params = {q.untyped_storage().data_ptr() for q in model.parameters()}
        storages: dict[int, int] = {}

        def pack(tensor, params=params, storages=storages):  # this iteration's, bound
            ptr = tensor.untyped_storage().data_ptr()
            if ptr not in params:
                storages[ptr] = tensor.untyped_storage().nbytes()
            return tensor

        layers = [unwrapped(layer) for layer in model.layers]  # the modules, not their Recompute
        modules = layers + [unwrapped(layer.core_attn) for layer in layers]
        with counted_forwards({type(m) for m in modules}) as calls:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t_: t_):
                y = model(x)
            saved = sum(storages.values())
            y.sum().backward()
            out[name] = {
                "bytes_per_layer": saved / len(model.layers),
                "units": units,
                "layer_calls": [calls(m) for m in layers],
                "attn_calls": [calls(unwrapped(m.core_attn)) for m in layers],
            }
    return out


def test_saved_memory_drops_and_forward_counts_match_method(world):
    names = ["none", "selective", "uniform1", "uniform2", "uniform3", "block2", "uniform1_reentrant"]
    res = world(2).run(_saved_bytes_and_counts, names, 2, True, 64)[0]
    mem = {k: v["bytes_per_layer"] for k, v in res.items()}
    assert mem["selective"] < mem["none"]
    assert mem["uniform1"] < mem["selective"]
    assert mem["uniform2"] < mem["uniform1"]  # one saved input per two layers
    assert mem["none"] > mem["block2"] > mem["uniform1"]
    assert mem["uniform1_reentrant"] < mem["selective"]

    assert res["none"]["layer_calls"] == [1, 1, 1, 1] and res["none"]["attn_calls"] == [1, 1, 1, 1]
    assert res["selective"]["layer_calls"] == [1, 1, 1, 1] and res["selective"]["attn_calls"] == [2, 2, 2, 2]
    for name in ("uniform1", "uniform2", "uniform3", "uniform1_reentrant"):
        assert res[name]["layer_calls"] == [2, 2, 2, 2], name
    assert res["block2"]["layer_calls"] == [2, 2, 1, 1]
    assert res["selective"]["units"] == [f"{i}.core_attn" for i in range(4)]
    assert res["uniform1"]["units"] == ["0", "1", "2", "3"]
    assert res["uniform2"]["units"] == ["0-1", "2-3"]
    assert res["uniform3"]["units"] == ["0-2", "3-3"]
    assert res["block2"]["units"] == ["0", "1"]


def test_distributed_saved_activations_keep_a_slice(world):
    res = world(2).run(_saved_bytes_and_counts, ["uniform1", "uniform1_dist"], 2, False, 64)[0]
    assert res["uniform1_dist"]["bytes_per_layer"] == pytest.approx(res["uniform1"]["bytes_per_layer"] / 2)


def _down_projections_and_grads(use_reentrant: bool | None):
    """Completed down-projection forwards per layer of a 2-layer Llama under full recompute, and
    the loss's gradients."""
    from transformers import LlamaConfig

    from neuron_ckpt.models import LlamaForCausalLM

    nc.initialize_model_parallel(1)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                         tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).train()
    apply_recompute(model, RecomputeConfig(granularity="full", method="uniform", num_layers=1,
                                           use_reentrant=use_reentrant))  # fmt: skip
    done = {i: 0 for i in range(2)}
    for i, layer in enumerate(model.layers):  # a forward hook runs only when forward returns
        layer.mlp.down_proj.register_forward_hook(lambda *_, i=i: done.__setitem__(i, done[i] + 1))
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids).loss.backward()
    return list(done.values()), {n: p.grad for n, p in model.named_parameters()}


def test_default_full_recompute_stops_before_the_last_matmul():
    """The default (non-reentrant off XLA) rerun stops once backward has every tensor it needs: the
    down projection's input is saved before its matmul runs and its output feeds only the
    residual add, so the matmul runs once per step; the reentrant variant reruns it. Gradients are
    the same bits."""
    default, grads = _single(lambda: _down_projections_and_grads(None))
    reentrant, grads_reentrant = _single(lambda: _down_projections_and_grads(True))
    assert default == [1, 1]
    assert reentrant == [2, 2]
    for name, g in grads.items():
        assert torch.equal(g, grads_reentrant[name]), name


# ---------------------------------------------------------------------------------------------
# Validation: every invalid combination fails at construction or apply, naming the field.


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(granularity="partial"), "granularity"),
        (dict(granularity="full", num_layers=2), "method"),
        (dict(granularity="full", method="uniform"), "num_layers"),
        (dict(granularity="full", method="uniform", num_layers=0), "num_layers"),
        (dict(granularity="full", method="uniform", num_layers=True), "num_layers"),
        (dict(granularity="full", method="diagonal", num_layers=1), "method"),
        (dict(granularity="selective", num_layers=2), "num_layers"),
        (dict(granularity="selective", method="block"), "method"),
        (dict(granularity="selective", modules=["core_attn", "softmax"]), "modules"),
        (dict(granularity="selective", modules="core_attn"), "modules"),
        (dict(granularity="selective", modules=[]), "modules"),
        (dict(num_layers=2), "num_layers"),
        (dict(method="block"), "method"),
        (dict(distribute_saved_activations=True), "distribute_saved_activations"),
        (dict(granularity="selective", distribute_saved_activations=True, use_reentrant=False), "use_reentrant"),
    ],
)
def test_invalid_config_raises(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RecomputeConfig(**kwargs)


def test_unknown_module_lists_known_ones():
    with pytest.raises(ValueError, match=r"core_attn.*mlp.*mlp_act.*norm"):
        RecomputeConfig(granularity="selective", modules=["attention"])
    assert RecomputeConfig(granularity="selective", modules=["layernorm"]).modules == ("norm",)


class PlainLayer(torch.nn.Module):
    """A user's own layer: no neuron_ckpt modules inside."""

    def __init__(self, h=8):
        super().__init__()
        self.attn = torch.nn.Linear(h, h)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(h, 2 * h), torch.nn.ReLU(), torch.nn.Linear(2 * h, h))
        self.norm = torch.nn.LayerNorm(h)

    def forward(self, x):
        return x + self.mlp(self.norm(x + torch.tanh(self.attn(x))))


def test_apply_validates_against_the_model_before_changing_it():
    layers = torch.nn.ModuleList(PlainLayer() for _ in range(3))
    with pytest.raises(ValueError, match="num_layers"):
        apply_recompute(layers, RecomputeConfig(granularity="full", method="block", num_layers=4))
    cfg = RecomputeConfig(granularity="full", method="uniform", num_layers=1, distribute_saved_activations=True)
    with pytest.raises(ValueError, match="distribute_saved_activations.*sequence_parallel"):
        apply_recompute(layers, cfg, sequence_parallel=True)
    # Default map: no CoreAttention in a plain layer -> the error says how to map it.
    with pytest.raises(ValueError, match="module_map"):
        apply_recompute(layers, RecomputeConfig(granularity="selective"))
    with pytest.raises(ValueError, match="module_map: unknown module 'attention'"):
        apply_recompute(layers, RecomputeConfig(granularity="selective"), module_map={"attention": "attn"})
    with pytest.raises(ValueError, match="module_map"):
        apply_recompute(layers, RecomputeConfig(granularity="selective"), module_map={"core_attn": 3})
    assert not any(isinstance(m, Recompute) for layer in layers for m in layer.modules())


def test_user_model_with_module_map_keeps_state_dict_and_gradients():
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(PlainLayer() for _ in range(4))
    keys = list(layers.state_dict())
    x = torch.randn(5, 8)

    def grads():
        for q in layers.parameters():
            q.grad = None
        run_layers(layers, x).pow(2).sum().backward()
        return [q.grad.clone() for q in layers.parameters()]

    ref = grads()
    configs = [
        (RecomputeConfig(granularity="selective", modules=["core_attn", "mlp", "norm"]), {"core_attn": "attn"}),
        (RecomputeConfig(granularity="selective", modules=["mlp_act"]), {"mlp_act": torch.nn.ReLU}),
        (RecomputeConfig(granularity="full", method="uniform", num_layers=2), None),
        (RecomputeConfig(granularity="full", method="block", num_layers=3, use_reentrant=False), None),
    ]
    names = [n for n, _ in layers.named_parameters()]
    torch.manual_seed(1)
    other = torch.nn.ModuleList(PlainLayer() for _ in range(4)).state_dict()  # written without recompute
    for cfg, module_map in configs:
        apply_recompute(layers, cfg, module_map=module_map)
        assert "Recompute[" in repr(layers)  # visible where it stands
        assert list(layers.state_dict()) == keys and [n for n, _ in layers.named_parameters()] == names
        mine = {k: v.clone() for k, v in layers.state_dict().items()}
        layers.load_state_dict(other)  # a checkpoint written without recompute loads...
        assert all(torch.equal(v, other[k]) for k, v in layers.state_dict().items())
        layers.load_state_dict(mine)  # ...and so does one written with it
        clean = torch.nn.ModuleList(PlainLayer() for _ in range(4))
        clean.load_state_dict(layers.state_dict())  # into a model without recompute
        assert all(torch.equal(v, mine[k]) for k, v in clean.state_dict().items())
        got = grads()  # x needs no grad: the reentrant variant must still give parameter grads
        assert all(torch.equal(a, b) for a, b in zip(ref, got)), cfg
    remove_recompute(layers)
    assert not any(isinstance(m, Recompute) for layer in layers for m in layer.modules())


def test_models_take_no_recompute_argument_apply_recompute_is_the_one_way_in():
    import inspect

    import neuron_ckpt.recompute as recompute
    from neuron_ckpt.models.gpt import GPTStack
    from neuron_ckpt.models.llama import LlamaForCausalLM

    for model in (LlamaForCausalLM, GPTStack):
        assert "recompute" not in inspect.signature(model.__init__).parameters, model
    assert "layer_runner" not in recompute.__all__ and not hasattr(recompute, "layer_runner")


def test_sequence_parallel_is_read_from_the_layers_unless_given():
    def check():
        nc.initialize_model_parallel(1)
        cfg = RecomputeConfig(granularity="full", method="uniform", num_layers=1, distribute_saved_activations=True)
        with pytest.raises(ValueError, match="distribute_saved_activations.*sequence_parallel"):
            apply_recompute(Stack(2, 16, 4, True, 0.0), cfg)  # built sequence parallel: refused
        assert apply_recompute(Stack(2, 16, 4, False, 0.0), cfg) == ["0", "1"]
        assert apply_recompute(Stack(2, 16, 4, True, 0.0), cfg, sequence_parallel=False) == ["0", "1"]  # given

    _single(check)


def test_grouped_layers_must_run_through_run_layers():
    layers = torch.nn.ModuleList(PlainLayer() for _ in range(4))
    apply_recompute(layers, RecomputeConfig(granularity="full", method="uniform", num_layers=2))
    with pytest.raises(RuntimeError, match="run_layers"):
        layers[1](torch.randn(2, 8))
    # per-layer methods work with any loop
    apply_recompute(layers, RecomputeConfig(granularity="full", method="uniform", num_layers=1))
    x = torch.randn(2, 8)
    for layer in layers:
        x = layer(x)


# ---------------------------------------------------------------------------------------------
# The checkpoint function itself.


def _fn(x, w, *, shift, name, bias=None):
    y = torch.nn.functional.dropout(x @ w, 0.5, True) + shift
    return (y, name, y.sum() + (bias.sum() if bias is not None else 0))


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpoint_passes_args_kwargs_and_tuples(use_reentrant):
    def run(ck):
        torch.manual_seed(0)
        x = torch.randn(4, 3, requires_grad=True)
        w = torch.randn(3, 3, requires_grad=True)
        bias = torch.randn(3, requires_grad=True)
        torch.manual_seed(5)
        y, name, s = ck(x, w, shift=2.0, name="n", bias=bias)
        assert name == "n"
        (y.pow(2).sum() + s).backward()
        return [x.grad, w.grad, bias.grad]

    ref = run(_fn)
    got = run(lambda *a, **k: checkpoint(_fn, *a, use_reentrant=use_reentrant, **k))
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


def test_checkpoint_runs_plainly_without_grad():
    with torch.no_grad():
        y = checkpoint(lambda x: x * 2, torch.ones(2))
    assert y.grad_fn is None and torch.equal(y, torch.full((2,), 2.0))


# ---------------------------------------------------------------------------------------------
# Selective names must land on a module whose forward runs.


class FusedPair(torch.nn.Module):
    """Uses its children's weights in one matmul; their forward never runs."""

    weights_only_children = ("a", "b")

    def __init__(self, h=8):
        super().__init__()
        self.a, self.b = torch.nn.Linear(h, h), torch.nn.Linear(h, h)
        self.act = torch.nn.ReLU()

    def forward(self, x):
        y = F.linear(x, torch.cat([self.a.weight, self.b.weight]), torch.cat([self.a.bias, self.b.bias]))
        return self.act(y[..., : x.shape[-1]] * y[..., x.shape[-1] :])


def test_module_map_refuses_a_submodule_whose_forward_never_runs():
    layers = torch.nn.ModuleList(torch.nn.Sequential(FusedPair()) for _ in range(2))
    cfg = RecomputeConfig(granularity="selective", modules=["mlp_act"])
    for pattern in ("a", "0.b", torch.nn.Linear, ("act", "a")):
        with pytest.raises(ValueError, match=r"matched '0\.[ab]' in layer 0.*FusedPair never runs the forward"):
            apply_recompute(layers, cfg, module_map={"mlp_act": pattern})
        assert not any(isinstance(m, Recompute) for m in layers.modules())  # nothing changed
    assert apply_recompute(layers, cfg, module_map={"mlp_act": "act"}) == ["0.0.act", "1.0.act"]


# ---------------------------------------------------------------------------------------------
# The dropout our layers use, exported for custom blocks.


def test_parallel_dropout_is_exported_keeps_a_byte_mask_and_replays():
    import neuron_ckpt.parallel as parallel
    from neuron_ckpt.parallel.attention import dropout as used_by_attention

    assert "dropout" in parallel.__all__ and parallel.dropout is used_by_attention
    assert "XLA" in parallel.dropout.__doc__ and "1/(1-p)" in parallel.dropout.__doc__
    x = torch.randn(64, 32, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t, lambda t: t):
        y = parallel.dropout(x, 0.25)
    assert saved == [torch.bool]  # the 1-byte mask, not a float noise tensor
    y.sum().backward()
    kept = y.detach() != 0
    assert torch.equal(x.grad, kept.float() / 0.75)  # scaled once
    assert parallel.dropout(x, 0.25, training=False) is x and parallel.dropout(x, 0.0) is x
    with pytest.raises(ValueError, match="probability"):
        parallel.dropout(x, 1.5)
    # Under recompute the mask is replayed exactly.
    w = torch.randn(32, 32, requires_grad=True)
    f = lambda x, w: parallel.dropout(x @ w, 0.5)  # noqa: E731
    torch.manual_seed(3)
    ref = f(x, w)
    ref.sum().backward()
    ref_grad = w.grad.clone()
    w.grad = None
    torch.manual_seed(3)
    out = checkpoint(f, x, w)
    out.sum().backward()
    assert torch.equal(out, ref) and torch.equal(w.grad, ref_grad)


def test_recompute_presets_have_one_owner():
    """The named recompute choices (planner, budget, memory reports, the tutorial's --recompute)
    are RecomputeConfig presets, and the budget's options carry exactly those configs."""
    from neuron_ckpt.memory import ModelShape, TrainingSetup, layer_options
    from neuron_ckpt.recompute import PRESETS

    assert PRESETS == ("none", "selective", "selective+mlp_act", "selective+mlp_act+norm", "full")
    assert RecomputeConfig.preset("none") == RecomputeConfig() and not RecomputeConfig.preset("none").enabled
    assert RecomputeConfig.preset("selective") == RecomputeConfig(granularity="selective", modules=("core_attn",))
    assert RecomputeConfig.preset("selective+mlp_act").modules == ("core_attn", "mlp_act")
    assert RecomputeConfig.preset("selective+mlp_act+norm").modules == ("core_attn", "mlp_act", "norm")
    full = RecomputeConfig.preset("full", distribute_saved_activations=True)
    assert (full.granularity, full.method, full.num_layers, full.distribute_saved_activations) == (
        "full",
        "uniform",
        1,
        True,
    )
    assert [RecomputeConfig.preset(n).preset_name for n in PRESETS] == list(PRESETS)
    assert full.preset_name == "full"
    assert RecomputeConfig(granularity="full", method="block", num_layers=2).preset_name is None
    assert RecomputeConfig(granularity="selective", modules=["mlp"]).preset_name is None
    options = layer_options(ModelShape("llama", 64, 4, 2, 176, 3, 128), TrainingSetup(seq_len=64))
    assert {name: o.recompute for name, o in options.items()} == {m: RecomputeConfig.preset(m) for m in PRESETS}
    with pytest.raises(ValueError, match="recompute must be one of"):
        RecomputeConfig.preset("selectve")
