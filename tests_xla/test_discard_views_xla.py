"""Output-discarding recompute on XLA when the op that keeps the output keeps a view of it (MLA's
q/k/v: core attention's matmuls keep k transposed and q, k reshaped for ``bmm``).

On CPU a kept view is recomputed as ``as_strided`` of the rerun's output with the view's size,
stride and offset. torch-xla reports every tensor's strides as contiguous for its own shape (a
transposed view's too) and lets ``view`` follow a transpose, so there no (size, stride, offset)
describes the view: ``as_strided`` with the reported ones reads other elements (measured: the
gradients below off by 0.7 to 1.1 times their largest element). On XLA the view's chain of view ops is replayed on the
rerun's output instead (neuron_ckpt/recompute/discard.py).
"""

from __future__ import annotations

import pytest
import torch
import torch_xla

from neuron_ckpt.recompute import checkpoint_without_output, discard_outputs

from .helpers import hlo

pytestmark = pytest.mark.usefixtures("xla")


def test_xla_reports_a_transposed_views_strides_as_contiguous(xla):
    x = torch.arange(12.0).view(3, 4)
    t = x.to(xla.device).t()
    assert t.stride() == (3, 1) and x.t().stride() == (1, 4)  # what torch-xla says, what it is
    assert not torch.equal(t.cpu(), x.to(xla.device).as_strided(t.size(), t.stride(), t.storage_offset()).cpu())


def _attention_scores(device, discard: bool, concat: bool) -> tuple[str, list[torch.Tensor]]:
    """q = a projection split into heads (a transposed view, or a concat of its halves as MLA's
    rope split builds q), then ``q @ q^T`` (matmul keeps q and q^T, reshaped for bmm)."""
    torch.manual_seed(0)
    proj = torch.nn.Linear(8, 16).to(device)
    x = torch.randn(2, 3, 8).to(device).requires_grad_()

    def heads(x: torch.Tensor) -> torch.Tensor:
        q = proj(x).view(2, 3, 2, 8).transpose(1, 2)
        if concat:
            nope, rope = torch.split(q, [4, 4], dim=-1)
            q = torch.cat((nope, rope * 2), dim=-1)
        return q

    with discard_outputs():
        q = checkpoint_without_output(heads, x, fence=(proj,)) if discard else heads(x)
        scores = torch.matmul(q, q.transpose(2, 3))
    scores.pow(2).sum().backward()
    grads = [x.grad, proj.weight.grad, proj.bias.grad]
    text = hlo(*grads)
    torch_xla.sync()
    return text, [g.cpu() for g in grads]


@pytest.mark.parametrize("concat", [False, True], ids=["transposed-view", "concat"])
def test_a_kept_view_of_a_discarded_output_is_the_recomputed_view(xla, concat):
    plain_text, plain = _attention_scores(xla.device, discard=False, concat=concat)
    text, grads = _attention_scores(xla.device, discard=True, concat=concat)
    assert "opt-barrier(" not in plain_text and text.count("opt-barrier(") == 1
    for a, b in zip(grads, plain):
        assert torch.equal(a, b)  # the rerun is the forward's ops on the same values
