"""Zero1Optimizer on XLA: every collective of a step stays under the bucket cap (read from the
lowered HLO), and fp32 gradient accumulation through post-accumulate-grad hooks works on XLA
tensors (same numbers as AdamW fed the exact gradient sum, one compiled graph per phase).

The cap check needs DP 2, which a one-process XLA:CPU world cannot run: the optimizer gets a
ParallelState whose DP group *looks like* two ranks (``ranks=(0, 0)``, replica groups ``[[0]]``,
as in test_collectives_xla.py), so it lays out, pads and slices buckets exactly as on two ranks
and emits DP-2 reduce-scatters (``shard_count`` is the group size). The step is only lowered,
never run: the numbers of such a group mean nothing.
"""

from __future__ import annotations

import gc
import re

import pytest
import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
from torch import nn

from neuron_ckpt.distributed import collectives
from neuron_ckpt.distributed.parallel_state import Group, ParallelState
from neuron_ckpt.optim import Zero1Optimizer
from tests.helpers import rel_norm

from .helpers import hlo

pytestmark = pytest.mark.usefixtures("xla")

CAP_BYTES = 256  # 64 fp32 / 128 bf16 elements; the model's 512-element weight is over it
BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s64": 8, "pred": 1}
COLLECTIVE = re.compile(r"= .*? (all-gather|reduce-scatter|all-reduce)\((.*?)\), replica_groups")
OPERAND = re.compile(r"(\w+)\[([\d,]*)\]")


def _model(dtype: torch.dtype, device) -> nn.Module:
    torch.manual_seed(0)
    # 512 + 32 + 256 + 8 = 808 elements.
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8)).to(dtype).to(device)


def _fake_dp2() -> ParallelState:
    one = Group(process_group=None, ranks=(0,), replica_groups=((0,),), rank=0)
    two = Group(process_group=None, ranks=(0, 0), replica_groups=((0,),), rank=0)
    return ParallelState(tp=one, dp=two)


def collectives_in(text: str) -> list[tuple[str, list[tuple[str, int]]]]:
    """``(op, [(dtype, bytes) of each operand])`` for every collective in HLO ``text``."""
    out = []
    for op, operands in COLLECTIVE.findall(text):
        sizes = []
        for dtype, dims in OPERAND.findall(operands):
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            sizes.append((dtype, n * BYTES[dtype]))
        out.append((op, sizes))
    return out


@pytest.fixture
def gather_as_two(monkeypatch):
    """Collectives as a DP-2 step issues them, lowered at world size 1.

    xm.all_gather takes its shard count from the replica groups, so with ``[[0]]`` it returns
    its operand's size; the result is repeated to the size two ranks return, which the copy into
    the parameters needs. The HLO all-gather keeps its real operand (this rank's 1/dp slice);
    the bytes it would return on two ranks are the operand's times two.
    """
    monkeypatch.setenv("XLA_ALWAYS_ALLREDUCE", "1")  # else xm.all_reduce drops out at world size 1
    real = collectives.all_gather

    def all_gather(tensor, dim, group):
        out = real(tensor, dim, group)
        return torch.cat([out] * group.size, dim) if out.shape[dim] == tensor.shape[dim] else out

    monkeypatch.setattr(collectives, "all_gather", all_gather)
    # xm chains collectives through a per-device token, so the next graph would contain these
    # never-run fake ones (and earlier tests' pending ones would show in this HLO): start and
    # end with a fresh token (what xm.set_replication does).
    _, ctx = xm._get_all_reduce_token()
    torch_xla._XLAC._set_all_reduce_token(ctx.device, None)
    yield
    torch_xla._XLAC._set_all_reduce_token(ctx.device, None)


def _lowered_step(
    xla, dtype: torch.dtype, cap_bytes: int | None, accumulate: bool | None
) -> tuple[str, Zero1Optimizer]:
    """HLO text of one optimizer step of :func:`_model` with a fake DP 2 (lowered, not run)."""
    model = _model(dtype, xla.device)
    opt = Zero1Optimizer(
        model.parameters(), parallel_state=_fake_dp2(), grad_clip_norm=1.0, lr=1e-2,
        bucket_cap_mb=cap_bytes and cap_bytes / 2**20, accumulate_fp32=accumulate,
    )  # fmt: skip
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1)).to(dtype).to(xla.device)
    model(x).float().pow(2).mean().backward()
    norm = opt.step()
    text = hlo(norm, *model.parameters())
    del model, norm, x  # never executed: drop the pending graph before anyone syncs
    gc.collect()
    return text, opt


@pytest.mark.parametrize(
    "dtype, accumulate, reduced_in",
    [(torch.bfloat16, None, "f32"), (torch.bfloat16, False, "bf16"), (torch.float32, None, "f32")],
    ids=["bf16_fp32_accum", "bf16_bf16_reduce", "fp32"],
)
def test_no_collective_of_a_step_exceeds_the_bucket_cap(xla, gather_as_two, dtype, accumulate, reduced_in):
    text, opt = _lowered_step(xla, dtype, CAP_BYTES, accumulate)
    ops = collectives_in(text)
    buckets = opt.buckets
    assert len(buckets) >= 4
    scatters = [s for op, s in ops if op == "reduce-scatter"]
    gathers = [s for op, s in ops if op == "all-gather"]
    reduces = [s for op, s in ops if op == "all-reduce"]
    assert len(scatters) == len(gathers) == len(buckets), ops  # one of each per bucket
    for (operand,) in scatters:
        assert operand[0] == reduced_in
        assert operand[1] <= CAP_BYTES, ops
    for (operand,) in gathers:
        assert operand[0] == {torch.bfloat16: "bf16", torch.float32: "f32"}[dtype]
        assert operand[1] * 2 <= CAP_BYTES, ops  # the result on two ranks: operand x dp
    assert reduces and all(b <= CAP_BYTES for operands in reduces for _, b in operands), ops  # the norm
    # Every gradient element is reduced once: the scatter operands tile the padded flat.
    itemsize = BYTES[reduced_in]
    assert sum(s[0][1] for s in scatters) // itemsize == 808
    opt.remove_hooks()


def test_the_check_sees_an_unbucketed_step_go_over_the_cap(xla, gather_as_two):
    """The negative control: without a cap the whole gradient is one 808-element reduce-scatter."""
    text, opt = _lowered_step(xla, torch.bfloat16, None, None)
    scatters = [s for op, s in collectives_in(text) if op == "reduce-scatter"]
    assert scatters == [[("f32", 808 * 4)]]
    opt.remove_hooks()


# ---- fp32 accumulation at world size 1: real numbers ---------------------------------------

MICRO, STEPS = 4, 3


def _batch(step: int, i: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + i)
    return torch.randn(8, 16, generator=g).to(torch.bfloat16).to(device), torch.randn(8, 8, generator=g).to(device)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x).float() - y).pow(2).mean() / MICRO


def test_fp32_accumulation_hooks_on_xla(xla):
    """bf16 model, 4 micro-batches a step with a sync after each (as the training loop does):
    p.grad is None after backward, the fp32 buffers hold the exact sum of the bf16 micro-batch
    gradients, the step equals clipped AdamW on that sum, and the graphs stop compiling."""
    device = xla.device
    model, twin = _model(torch.bfloat16, device), _model(torch.bfloat16, device)
    opt = Zero1Optimizer(
        model.parameters(), grad_clip_norm=0.01, lr=1e-2, weight_decay=0.1, bucket_cap_mb=CAP_BYTES / 2**20
    )
    masters = [torch.nn.Parameter(p.detach().cpu().float()) for p in model.parameters()]
    ref_opt = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1)
    compiles = []
    for step in range(STEPS):
        opt.zero_grad()
        exact = [torch.zeros(p.shape, dtype=torch.float64) for p in model.parameters()]
        for i in range(MICRO):
            x, y = _batch(step, i, device)
            _loss(model, x, y).backward()
            assert all(p.grad is None for p in model.parameters())
            _loss(twin, x, y).backward()  # the same bf16 gradients, read one micro-batch at a time
            for e, p in zip(exact, twin.parameters()):
                e += p.grad.cpu().double()
                p.grad = None
            torch_xla.sync()
        for e, p in zip(exact, model.parameters()):
            # fp32 sums of the same bf16 values in the same order as fp64 ones: ulps at most.
            assert rel_norm(opt.accumulated_grad(p), e) < 1e-6
        norm = opt.step()
        torch_xla.sync()
        xm.wait_device_ops()  # metrics are recorded when the graph finishes
        compiles.append((met.metric_data("CompileTime") or (0,))[0])

        for m, e in zip(masters, exact):
            m.grad = e.float()
        ref_norm = torch.nn.utils.clip_grad_norm_(masters, 0.01)
        ref_opt.step()
        # fp32 step on XLA against eager fp32: summation order only (helpers.TOL rationale).
        assert rel_norm(norm, ref_norm) < 1e-5
        assert norm.item() > 0.01  # clipping was active
        mine = torch.cat([b.master.cpu() for b in opt.buckets])[:808]
        assert rel_norm(mine, torch.cat([m.detach().reshape(-1) for m in masters])) < 1e-5
        # The bf16 parameters are the fp32 master weights rounded.
        assert torch.equal(torch.cat([p.cpu().reshape(-1) for p in model.parameters()]), mine.to(torch.bfloat16))
        twin.load_state_dict(model.state_dict())
    assert compiles[1] == compiles[2], compiles  # nothing new compiles after the first step
    opt.remove_hooks()
