"""Neuron-friendly lowering: no collective along the last dim, no ``-inf`` in the causal mask.

Cross entropy: lowered with a world-1 group made to look like size 2 (``ranks=(0, 0)``, replica
groups ``[[0]]``; see test_collectives_xla.py) so the XLA collectives are emitted. Checked on the
HLO text of the forward (loss) and of the backward (the logits' gradient): an all-reduce whose
reduction computation is a ``maximum`` is present, there is no ``all-gather``, and no collective
names the last dimension in ``dimensions={...}``. Over a one-member replica group every
all-reduce is the identity and ``group.rank`` is 0, so with all targets in the first ``v/2`` ids
the numbers equal a dense ``F.cross_entropy`` on the CPU: checked too.

Causal mask (world size 1): the scalar filled above the diagonal is not a literal in the HLO but
a graph input (torch-xla passes non-special Python scalars as device data), so both are checked:
no ``-inf`` among the graph's inputs and ``finfo(dtype).min`` among them; and every
``constant(-inf)`` of the HLO is only the identity of the softmax's max reduction (torch-xla's
lowering of ``softmax``, not a mask). A control run with the mask patched back to ``-inf`` shows
the check sees it. Numerics against eager CPU in fp32 (tolerance ``helpers.TOL``).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch_xla

import neuron_ckpt.parallel.attention as attention
from neuron_ckpt.distributed.parallel_state import Group
from neuron_ckpt.parallel import CoreAttention, vocab_parallel_cross_entropy
from tests.helpers import rel_norm

from .helpers import TOL, hlo

pytestmark = pytest.mark.usefixtures("xla")

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
S, B, V = 8, 2, 12


@pytest.fixture
def always_all_reduce(monkeypatch):
    # xm.all_reduce returns its input unchanged at world size 1 unless told otherwise.
    monkeypatch.setenv("XLA_ALWAYS_ALLREDUCE", "1")


def _looks_like_two() -> Group:
    return Group(process_group=None, ranks=(0, 0), replica_groups=((0,),), rank=0)


def _computations(text: str) -> dict[str, str]:
    """Name -> body of every computation in an HLO module's text."""
    return {m.group(1): m.group(2) for m in re.finditer(r"^(?:ENTRY )?%(\S+) [^\n]*\{\n(.*?)^\}", text, re.M | re.S)}


def _collective_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if any(f" {op}(" in line for op in COLLECTIVES)]


def _check_collectives(text: str, last_dim: int) -> None:
    lines = _collective_lines(text)
    assert "all-gather" not in text, text
    bodies = _computations(text)
    max_reduces = [
        line
        for line in lines
        if " all-reduce(" in line and "maximum(" in bodies.get(re.search(r"to_apply=%([\w.-]+)", line).group(1), "")
    ]
    assert max_reduces, "no all-reduce with a maximum computation in\n" + "\n".join(lines)
    for line in lines:
        dims = re.search(r"dimensions=\{([\d,]*)\}", line)
        named = {int(d) for d in dims.group(1).split(",") if d} if dims else set()
        assert last_dim not in named, f"collective along the last dim {last_dim}: {line}"


def test_cross_entropy_lowers_a_max_all_reduce_and_no_last_dim_collective(xla, always_all_reduce):
    g = torch.Generator().manual_seed(0)
    logits_cpu = 4 * torch.randn(S, B, V, generator=g)
    target_cpu = torch.randint(0, V, (S, B), generator=g)
    target_cpu[2, 1] = -100

    logits = logits_cpu.to(xla.device).requires_grad_()
    target = target_cpu.to(xla.device)
    loss = vocab_parallel_cross_entropy(logits, target, ignore_index=-100, group=_looks_like_two())
    forward = hlo(loss)
    _check_collectives(forward, last_dim=logits.dim() - 1)
    assert len(re.findall(r" all-reduce\(", forward)) == 2, forward  # MAX, then the stacked SUM
    loss.backward()
    backward = hlo(logits.grad)
    _check_collectives(backward, last_dim=logits.dim() - 1)
    torch_xla.sync()

    ref_logits = logits_cpu.clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(ref_logits.view(-1, V), target_cpu.view(-1), ignore_index=-100)
    ref.backward()
    assert rel_norm(loss, ref) < TOL
    assert rel_norm(logits.grad, ref_logits.grad) < TOL


def test_the_collective_check_sees_a_last_dim_gather(xla, always_all_reduce):
    # Control: the previous max (an all-gather of the local maxima along the last dim) fails it.
    from neuron_ckpt.distributed import collectives as C

    x = torch.randn(S, B, 1).to(xla.device)
    gathered = C.all_gather(x, -1, _looks_like_two()).amax(-1)
    with pytest.raises(AssertionError):
        _check_collectives(hlo(gathered), last_dim=2)
    torch_xla.sync()


def _attention(device, dtype: torch.dtype):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(S, B, n * 8, generator=g).to(dtype) for n in (4, 2, 2))
    xs = [x.to(device).requires_grad_() for x in (q, k, v)]
    out = CoreAttention(4, 2, 8, implementation="explicit")(*xs)
    return out, xs


def _inf_problems(tensors: list[torch.Tensor], dtype: torch.dtype) -> list[str]:
    """Why the graph computing ``tensors`` has a ``-inf`` mask; empty when it has none."""
    problems = []
    text = hlo(*tensors)
    for name in re.findall(r"%(\S+) = \S+ constant\(-inf\)", text):
        for line in text.splitlines():
            if re.search(rf"%{re.escape(name)}\b", line) and "constant(-inf)" not in line:
                is_max_init = " reduce(" in line and re.search(rf", \S+ %{re.escape(name)}\)", line)
                body = (
                    _computations(text).get(re.search(r"to_apply=%([\w.-]+)", line).group(1), "") if is_max_init else ""
                )
                if "maximum(" not in body:
                    problems.append(f"-inf constant used outside a max reduction: {line.strip()}")
    _, data = torch_xla._XLAC._get_tensors_xla_device_data_node(list(tensors))
    scalars = [d.cpu().item() for d in data if d.dim() == 0]
    if any(s == float("-inf") for s in scalars):
        problems.append(f"-inf among the graph's scalar inputs {scalars}")
    if torch.finfo(dtype).min not in scalars:
        problems.append(f"finfo({dtype}).min not among the graph's scalar inputs {scalars}")
    return problems


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_causal_mask_lowers_without_minus_inf(xla, dtype):
    out, xs = _attention(xla.device, dtype)
    assert not _inf_problems([out], dtype)
    out.float().sum().backward()
    assert not _inf_problems([x.grad for x in xs], dtype)
    torch_xla.sync()


def test_the_inf_check_sees_an_inf_mask(xla, monkeypatch):
    monkeypatch.setattr(attention, "masked_score", lambda dtype: float("-inf"))
    out, _ = _attention(xla.device, torch.float32)
    problems = _inf_problems([out], torch.float32)
    assert any("-inf among" in p for p in problems), problems
    torch_xla.sync()


def test_finite_mask_attention_on_xla_equals_eager_cpu(xla):
    r = torch.randn(S, B, 32, generator=torch.Generator().manual_seed(2))
    results = []
    for device in (xla.device, torch.device("cpu")):
        out, xs = _attention(device, torch.float32)
        (out * r.to(device)).sum().backward()
        if device.type == "xla":
            torch_xla.sync()
        results.append([out.detach().cpu()] + [x.grad.cpu() for x in xs])
    errors = {name: rel_norm(a, b) for name, a, b in zip(("out", "dq", "dk", "dv"), *results)}
    assert all(e < TOL for e in errors.values()), errors
