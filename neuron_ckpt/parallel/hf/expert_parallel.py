"""Expert parallelism on transformers MoE models: the ``ep_plan`` styles.

With ``expert_model_parallel_size`` e > 1, :func:`~.plan.apply_tensor_parallel` applies the
model's own expert-parallel plan (``model.ep_plan``: transformers 5.x's ``base_model_ep_plan``,
the same on Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3 and GPT-OSS) over its tensor-parallel
plan; the plan's entries on the experts (``moe_tp_experts``, ``packed_colwise``, ``rowwise``)
give way to it, since experts run whole on their EP rank (expert tensor parallel size 1):

=================================================  ==============================================
plan entry                                         becomes
=================================================  ==============================================
``experts.gate_up_proj: grouped_gemm`` (every      dim 0 sliced over EP: rank ``j`` keeps experts
3-D weight and 2-D bias of the experts)            ``[j E/e, (j+1) E/e)``, tagged ``expert_parallel``
``experts: ep_dispatch_experts``                   ``num_experts`` set to ``E/e``; each call's
                                                   tokens dispatched to their experts' ranks and
                                                   combined back (:mod:`neuron_ckpt.parallel.experts`)
=================================================  ==============================================

Parameter names do not change; a state dict holds this rank's experts, and ``load_state_dict``
takes either those or the whole ``[E, ...]`` tensors (sliced on the way in). The router and
everything else stay as the tensor-parallel plan leaves them. The experts module is called as
transformers' MoE blocks call it, ``experts(hidden_states [T, h], top_k_index [T, k],
top_k_weights [T, k])``; a forward pre-hook dispatches (the experts then compute the rows this
rank received, each through one local expert) and a forward hook combines, so every experts
implementation (eager loop, ``grouped_mm``, ``batched_mm``; GPT-OSS's biases and clamped SwiGLU)
runs unchanged on whole experts, and ``moe`` / ``moe_act`` recompute wrap them as before.

**TP > 1** (with or without sequence parallel): the MoE block sees the whole sequence on every TP
rank (it is a sequence-parallel region, or TP is all there is), so each TP rank dispatches only
its own ``s/t`` of the sequence (the chunk sequence parallel gives it), and the combined output is
all-gathered over TP along the sequence (backward: this rank's chunk). Every token is computed
once, the router's and the routing weights' gradients are whole on every TP rank, and the expert
weights' gradients are complete over the EP x expert-DP grid. Megatron refuses EP with TP > 1
and no sequence parallel; transformers' ``AllToAllEP`` slices rows per TP rank as here. The
sequence length must divide by the TP size (one line at the first call otherwise).

Checked before anything changes (one line each): a model without ``ep_plan``; ``E % e``; an
experts module with a parameter the plan does not slice, or a sliced weight whose module is not
dispatched; ``ep_dispatch_experts`` at e = 1; the all-to-all form on XLA, and transformers'
``grouped_mm`` on XLA.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch

from ...distributed import collectives as C
from ...distributed import runtime
from ...distributed.mappings import gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region
from ...distributed.parallel_state import ParallelState
from ..experts import all_gather, all_to_all
from ..experts.dispatch import ExpertDispatch
from .shards import take
from .style import Split, Style, Target, no_check

DISPATCH = "ep_dispatch_experts"
SLICE = "grouped_gemm"
EP_STYLES = (DISPATCH, SLICE)


def expert_parallel_plan(model: torch.nn.Module, plan: dict[str, str], state: ParallelState) -> dict[str, str]:
    """``plan`` with the model's ``ep_plan`` laid over it at e > 1 (its entries on a dispatched
    experts module and below it dropped); ``plan`` as it is when it already holds EP styles."""
    has_ep = [k for k, s in plan.items() if s in EP_STYLES]
    if state.ep_size == 1:
        if has_ep:
            raise ValueError(
                f"apply_tensor_parallel: plan entry {has_ep[0]!r} ({plan[has_ep[0]]}) needs expert_model_parallel_size "
                "> 1; at 1 the experts split over TP by the tensor-parallel plan"
            )
        return plan
    if has_ep:
        return plan
    ep_plan = getattr(model, "ep_plan", None)
    if not ep_plan:
        raise ValueError(
            f"apply_tensor_parallel: {type(model).__name__} has no expert-parallel plan (model.ep_plan), and "
            f"expert_model_parallel_size is {state.ep_size}; pass plan= with 'ep_dispatch_experts' / 'grouped_gemm' "
            "entries, or initialise with expert_model_parallel_size=1"
        )
    dispatched = [k for k, s in ep_plan.items() if s == DISPATCH]
    kept = {k: s for k, s in plan.items() if not any(k == d or k.startswith(d + ".") for d in dispatched)}
    return {**kept, **ep_plan}


def check_expert_parallel(model: torch.nn.Module, targets: list[Target], state: ParallelState, form: str) -> None:
    """The checks across EP targets (module docstring), before anything changes."""
    dispatched = [t for t in targets if t.style == DISPATCH]
    sliced = {t.name: t for t in targets if t.style == SLICE}
    names = {t.name for t in dispatched}
    for t in sliced.values():
        if t.name.rpartition(".")[0] not in names:
            raise ValueError(
                f"{t.where}: its module {t.name.rpartition('.')[0]} is not planned '{DISPATCH}': its experts would be "
                "sliced but no token sent to them"
            )
    e = state.ep_size
    on_xla = runtime.is_xla() or any(p.device.type == "xla" for p in model.parameters())
    for t in dispatched:
        weights = {n: p for n, p in t.module.named_parameters(recurse=False)}
        experts = [p.shape[0] for p in weights.values() if p.dim() == 3]
        if not experts:
            raise ValueError(
                f"{t.where}: needs an experts module holding 3-D expert weights, got {type(t.module).__name__}"
            )
        unsliced = sorted(n for n in weights if f"{t.name}.{n}" not in sliced)
        if unsliced:
            raise ValueError(
                f"{t.where}: {', '.join(unsliced)} not planned '{SLICE}': every rank would keep all experts' "
                "values of it; plan every parameter of the experts"
            )
        wrong = sorted(n for n, p in weights.items() if p.shape[0] != experts[0])
        if wrong:
            raise ValueError(f"{t.where}: {', '.join(wrong)} do not have the {experts[0]} experts on dim 0")
        if experts[0] % e:
            raise ValueError(
                f"{t.where}: {experts[0]} experts do not split over expert_model_parallel_size {e}; "
                f"allowed: {[d for d in range(1, experts[0] + 1) if experts[0] % d == 0]}"
            )
        if len(_call_names(t.module)) < 3:
            raise ValueError(
                f"{t.where}: {type(t.module).__name__}.forward does not take (hidden_states, top_k_index, "
                "top_k_weights): there is no routing to dispatch"
            )
        if on_xla and form == "all_to_all":
            raise ValueError(
                f"{t.where}: the all_to_all dispatch does not run on XLA; use ExpertDispatch('all_gather')"
            )
    if on_xla and dispatched:
        from ...recompute.xla_experts import check_experts_implementation

        check_experts_implementation(model)


def _call_names(experts: torch.nn.Module) -> list[str]:
    """The names of the experts forward's first three parameters (hidden, indices, weights)."""
    params = inspect.signature(experts.forward).parameters.values()
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:3]


def _apply_slice(target: Target, split: Split) -> None:
    full = getattr(target.module, target.param)  # type: ignore[arg-type]  # a parameter target names its param
    take(target.module, target.param, full, 0, split.state.ep_size, split.state.ep_rank, expert=True)  # type: ignore[arg-type]  # a parameter target names its param


def _apply_dispatch(target: Target, split: Split) -> None:
    experts = target.module
    whole = next(p.shape[0] for p in experts.parameters(recurse=False) if p.dim() == 3)
    hooks = ExpertParallelHooks(whole, split.state, split.expert_dispatch, _call_names(experts))
    experts.num_experts = whole // split.state.ep_size  # type: ignore[assignment]  # torch types a module's attributes as Tensor | Module
    block = split.model.get_submodule(target.name.rpartition(".")[0])  # the MoE block ("": the model itself)
    block.register_forward_pre_hook(hooks.record_batch, with_kwargs=True)
    experts.register_forward_pre_hook(hooks.enter, with_kwargs=True)
    experts.register_forward_hook(hooks.leave, with_kwargs=True, always_call=True)
    experts.__dict__["_expert_parallel"] = hooks


class ExpertParallelHooks:
    """The dispatch (a forward pre-hook of the experts) and the combine (its forward hook) of one
    experts module; ``dropped`` is the routes this rank's experts dropped in the last call (the
    all-gather form with a capacity; 0 otherwise), ``received`` the rows they got (the all-to-all:
    the routes sent here, before the zero row of an empty receive; the all-gather: the slots)."""

    def __init__(self, num_experts: int, state: ParallelState, dispatch: ExpertDispatch, names: list[str]):
        assert state.ep is not None  # applied at expert_model_parallel_size > 1
        self.num_experts, self.ep, self.tp, self.names = num_experts, state.ep, state.tp, names
        self.dispatch, self.form = dispatch, dispatch.resolved_form()
        self.batch = 1
        self.dropped: torch.Tensor = torch.zeros((), dtype=torch.int64)
        self.received = 0  # rows this rank's experts got in the last call (all-to-all: routes; all-gather: slots)
        self._trips: list[tuple[Any, torch.Tensor, int]] = []  # (trip, this rank's weights, sequence length)

    def record_batch(self, block, args, kwargs) -> None:
        x = args[0] if args else kwargs.get("hidden_states")
        self.batch = x.shape[0] if torch.is_tensor(x) and x.dim() == 3 else 1

    def _own(self, x: torch.Tensor, length: int) -> torch.Tensor:
        """This TP rank's chunk of the sequence of ``x [b s, ...]``; the gradient all-gathered."""
        b, t = self.batch, self.tp
        view = x.reshape(b, length, *x.shape[1:])
        chunk = scatter_to_sequence_parallel_region(view, t, dim=1) if x.is_floating_point() else C.split(view, 1, t)
        return chunk.reshape(-1, *x.shape[1:])

    def enter(self, module, args, kwargs):
        hidden, index, weights = (args[i] if i < len(args) else kwargs[n] for i, n in enumerate(self.names))
        kwargs = {k: v for k, v in kwargs.items() if k not in self.names}
        length = hidden.shape[0] // self.batch
        if self.tp.size > 1:
            if length % self.tp.size or hidden.shape[0] % self.batch:
                raise ValueError(
                    f"expert parallel: {module.__class__.__name__} got {hidden.shape[0]} tokens (batch {self.batch}); "
                    f"each of the {self.tp.size} tensor-parallel ranks dispatches its own 1/{self.tp.size} of the "
                    "sequence, which must divide by the tensor-parallel size"
                )
            hidden, index, weights = (self._own(v, length) for v in (hidden, index, weights))
        trip: all_to_all.Trip | all_gather.Trip
        if self.form == "all_to_all":
            routed, trip = all_to_all.dispatch(hidden, index, self.num_experts, self.ep)
            self.received = sum(trip.receive)
        else:
            capacity = self.dispatch.capacity(hidden.shape[0] * self.ep.size, index.shape[1], self.num_experts)
            routed, gathered = all_gather.dispatch(hidden, index, weights, self.num_experts, self.ep, capacity)
            trip, self.dropped, self.received = gathered, gathered.dropped, routed.rows.shape[0]
        self._trips.append((trip, weights, length))
        weights_in = routed.weights.to(weights.dtype).unsqueeze(-1)
        return (routed.rows, routed.experts.unsqueeze(-1), weights_in, *args[3:]), kwargs

    def leave(self, module, args, kwargs, output):
        trip, weights, length = self._trips.pop()
        if sys.exc_info()[0] is not None:  # always_call: the forward raised; let it through
            return None
        if self.form == "all_to_all":
            y = all_to_all.combine(output, trip, weights)
        else:
            y = all_gather.combine(output, trip)
        if self.tp.size > 1:
            view = y.reshape(self.batch, -1, y.shape[-1])
            y = gather_from_sequence_parallel_region(view, self.tp, tensor_parallel_output_grad=False, dim=1)
            y = y.reshape(self.batch * length, -1)
        return y


def dropped_routes(model: torch.nn.Module) -> torch.Tensor:
    """Routes this rank's experts dropped in the model's last forward, summed over its layers (a
    device tensor: reading it syncs; sum it over the EP group for the group's count). Non-zero only
    with the all-gather dispatch at a ``capacity_factor``."""
    hooks = [m.__dict__["_expert_parallel"] for m in model.modules() if "_expert_parallel" in m.__dict__]
    device = next(model.parameters()).device
    return sum((h.dropped.to(device) for h in hooks), torch.zeros((), dtype=torch.int64, device=device))


EP_MODULE_STYLES: dict[str, Style] = {DISPATCH: Style(no_check, _apply_dispatch)}
"""Styles of modules."""
EP_WEIGHT_STYLES: dict[str, Style] = {SLICE: Style(no_check, _apply_slice)}
"""Styles of plan entries that name an expert weight or bias."""
