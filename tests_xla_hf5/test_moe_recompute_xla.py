"""Megatron's recompute modules for mixture-of-experts and latent attention (``moe``, ``moe_act``,
``shared_experts``, ``mla_up_proj``) in a training step on the XLA device: tiny Mixtral and
DeepSeek-V3 (MLA, a dense first layer, shared experts) built from configs, experts on
``batched_mm`` (the implementation that lowers on XLA: neuron_ckpt/recompute/xla_experts.py),
attention dropout and Mixtral's router jitter on, the load-balancing loss with an attention mask
(without one transformers counts with an int32 ``histc`` XLA cannot run: test_experts_xla.py).

* Loss, aux loss and every gradient equal the same step without recompute bit for bit: XLA gives
  that here (the rerun is the forward's ops on the same values; dropout and jitter are replayed).
* Fenced: the step's lowered HLO holds one ``opt-barrier`` per recomputed unit, passing the unit's
  parameters, and the recomputed ops a second time (what the barrier keeps XLA's CSE from merging
  into the forward: tests_xla/test_recompute_xla.py).
* Routing is replayed: DeepSeek's selection-only ``e_score_correction_bias`` moved between
  forward and backward leaves the gradients those of the forward's routing (and without the
  replay it does not); Mixtral's rerun answers its ``topk`` from the replay.
* The aux loss counts each layer once and trains the router (XLA's checkpoint is the reentrant
  variant, whose forward runs without grad).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import pytest
import torch
import torch_xla

import neuron_ckpt as nc
from neuron_ckpt.recompute import RecomputeConfig, apply_recompute, unwrapped
from neuron_ckpt.recompute import moe as moe_recompute
from neuron_ckpt.recompute.routing import RoutingReplay
from tests.test_hf_moe_recompute import _ids, _shift_bias
from tests.test_hf_moe_recompute import tiny as cpu_tiny
from tests_xla.helpers import hlo

pytestmark = pytest.mark.usefixtures("xla")

MOE_LAYERS = {"mixtral": [0, 1], "deepseek_v3": [1]}  # DeepSeek's first layer is dense
# Where each module applies, and the op its rerun adds to the step's graph per unit: the ops of
# the rerun whose values a gradient reads (the lowered graph holds nothing else). moe: the
# router's matmul and the experts' two batched matmuls (the down one's output is read by the
# routing weights' gradient), on DeepSeek also the shared experts' gate and up projections (their
# down projection's output is read by no gradient); moe_act: the experts' SiLU; shared_experts:
# its gate and up projections; mla_up_proj: q_b_proj and kv_b_proj.
UNITS = {"moe": "mlp", "moe_act": "mlp.experts", "shared_experts": "mlp.shared_experts", "mla_up_proj": "self_attn"}
RERUN = {("mixtral", "moe"): (" dot(", 3), ("deepseek_v3", "moe"): (" dot(", 5),
         ("mixtral", "moe_act"): ("logistic(", 1), ("deepseek_v3", "moe_act"): ("logistic(", 1),
         ("deepseek_v3", "shared_experts"): (" dot(", 2), ("deepseek_v3", "mla_up_proj"): (" dot(", 2)}  # fmt: skip


def tiny(family: str):
    """The eager suite's tiny model (2 layers, hidden 32, 4 experts, top 2, attention dropout 0.1,
    Mixtral's jitter 0.1), experts on batched_mm, moved to the XLA device."""
    return cpu_tiny(family, "batched_mm").to(torch_xla.device())


@dataclass
class Step:
    loss: torch.Tensor
    aux: torch.Tensor | None
    router_logits: int  # how many layers' router logits the output holds
    grads: dict[str, torch.Tensor]
    hlo: str  # the step's lowered graph (forward and backward), before XLA's passes


def step(model, between=None) -> Step:
    """One training step on XLA (dropout and jitter from seed 2); ``between(model)`` runs between
    forward and backward."""
    nc.model_parallel_manual_seed(2)
    ids = _ids().to(torch_xla.device())
    out = model(input_ids=ids, labels=ids, attention_mask=torch.ones_like(ids))
    if between is not None:
        between(model)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    aux = getattr(out, "aux_loss", None)
    text = hlo(out.loss, *grads.values())
    torch_xla.sync()
    return Step(out.loss.cpu(), None if aux is None else aux.cpu(), len(out.router_logits),
                {n: g.cpu() for n, g in grads.items()}, text)  # fmt: skip


def assert_equal(got: Step, reference: Step) -> None:
    assert torch.equal(got.loss, reference.loss), (got.loss, reference.loss)
    assert (got.aux is None) == (reference.aux is None)
    assert got.aux is None or torch.equal(got.aux, reference.aux), (got.aux, reference.aux)
    assert got.router_logits == reference.router_logits, "router logits recorded"
    assert got.grads.keys() == reference.grads.keys()
    assert [n for n, g in got.grads.items() if not torch.equal(g, reference.grads[n])] == []


_REFERENCE: dict = {}


def reference(family: str) -> Step:
    if family not in _REFERENCE:
        _REFERENCE[family] = step(tiny(family))
    return _REFERENCE[family]


def selective(*modules: str) -> RecomputeConfig:
    return RecomputeConfig(granularity="selective", modules=list(modules))


def barrier_operands(text: str) -> list[str]:
    """The operand types of each ``opt-barrier`` in ``text``, e.g. ``"(f32[4,32]{1,0}, ...)"``."""
    return re.findall(r"= (\(.*\)) opt-barrier\(", text)


def xla_type(t: torch.Tensor) -> str:
    return "f32[" + ",".join(map(str, t.shape)) + "]"


@pytest.mark.parametrize("family,module", list(RERUN))
def test_each_module_equals_no_recompute_and_its_rerun_is_fenced(family, module):
    model = tiny(family)
    names = apply_recompute(model, selective(module))
    layers = [0, 1] if module == "mla_up_proj" else MOE_LAYERS[family]
    assert names == [f"{i}.{UNITS[module]}" for i in layers]
    got, ref = step(model), reference(family)
    assert_equal(got, ref)

    assert "opt-barrier(" not in ref.hlo
    operands = barrier_operands(got.hlo)
    assert len(operands) == len(names), operands
    for i, types in zip(layers, operands):
        unit = unwrapped(model.model.layers[i]).get_submodule(UNITS[module])
        assert all(xla_type(p) + "{" in types for p in unwrapped(unit).parameters()), (types, i)
    op, per_unit = RERUN[family, module]
    assert got.hlo.count(op) == ref.hlo.count(op) + per_unit * len(names)


def test_the_rerun_replays_the_forwards_routing(monkeypatch):
    """DeepSeek's selection-only bias moved between forward and backward (``_shift_bias``): a
    rerun that routed again would send every token to experts 0 and 1."""
    shifted = step(tiny("deepseek_v3"), between=_shift_bias)
    assert_equal(shifted, reference("deepseek_v3"))  # without recompute the bias is read once
    model = tiny("deepseek_v3")
    apply_recompute(model, selective("moe"))
    assert_equal(step(model, between=_shift_bias), shifted)

    # Without the replay the rerun routes again, with the moved bias: other gradients.
    monkeypatch.setattr(moe_recompute, "RoutingReplay", contextlib.nullcontext)
    model = tiny("deepseek_v3")
    apply_recompute(model, selective("moe"))
    got = step(model, between=_shift_bias)
    assert any(not torch.equal(got.grads[n], shifted.grads[n]) for n in shifted.grads)


def test_aux_loss_counts_each_layer_once_and_trains_the_router(monkeypatch):
    model = tiny("mixtral")
    apply_recompute(model, selective("moe"))
    routed, replayed = [], []
    for i in MOE_LAYERS["mixtral"]:
        unwrapped(unwrapped(model.model.layers[i]).mlp).gate.register_forward_hook(lambda *_: routed.append(1))
    replay = RoutingReplay._replay
    monkeypatch.setattr(RoutingReplay, "_replay", lambda self, *a, **k: replayed.append(1) or replay(self, *a, **k))
    got = step(model)
    assert len(routed) == 4 and len(replayed) == 2  # each router ran again in backward, its topk replayed
    assert_equal(got, reference("mixtral"))  # 2 router logits, the same aux loss and router gradients

    # Why the router's outputs leave the checkpoint: recorded inside a forward without grad, the
    # aux loss would not reach the router.
    monkeypatch.setattr(moe_recompute, "_capture", lambda *_: None)
    model = tiny("mixtral")
    apply_recompute(model, selective("moe"))
    got = step(model)
    assert torch.equal(got.aux, reference("mixtral").aux)
    gate = "model.layers.0.mlp.gate.weight"
    assert not torch.equal(got.grads[gate], reference("mixtral").grads[gate])
