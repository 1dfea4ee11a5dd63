"""SavedTensorRecorder counts exactly the distinct storages autograd keeps for backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from neuron_ckpt.memory.measure import (
    UNSCOPED,
    SavedTensorRecorder,
    device_peak_bytes,
    reset_device_peak,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@pytest.mark.parametrize("device", DEVICES)
def test_linear_saves_its_input_and_the_weight_is_left_out(device):
    lin = torch.nn.Linear(16, 8, device=device)
    x = torch.randn(4, 16, device=device, requires_grad=True)
    with SavedTensorRecorder(exclude_modules=[lin]) as rec:
        y = F.linear(x, lin.weight, lin.bias)
    assert rec.total_bytes == _nbytes(x) == 4 * 16 * 4
    assert [s.shape for s in rec.storages] == [(4, 16)]
    with SavedTensorRecorder() as without_exclusion:
        y = F.linear(x, lin.weight, lin.bias)
    assert without_exclusion.total_bytes == _nbytes(x) + _nbytes(lin.weight)
    del y


def test_gelu_saves_its_input():
    x = torch.randn(3, 5, requires_grad=True)
    with SavedTensorRecorder() as rec:
        y = F.gelu(x)
    assert rec.total_bytes == _nbytes(x)
    assert rec.storages[0].dtype == torch.float32
    del y


def test_the_same_tensor_saved_twice_counts_once():
    x = torch.randn(64, requires_grad=True)
    with SavedTensorRecorder() as rec:
        y = x * x  # mul saves both operands: the same tensor twice
    assert rec.total_bytes == _nbytes(x)
    assert rec.storages[0].times_saved == 2
    del y


def test_views_of_one_storage_count_the_whole_storage_once():
    base = torch.randn(8, 16, requires_grad=True)
    with SavedTensorRecorder() as rec:
        top, bottom = base[:4], base[4:]
        y = top * bottom
    assert rec.total_bytes == _nbytes(base)
    assert len(rec.storages) == 1
    del y


@pytest.mark.parametrize("device", DEVICES)
def test_native_dropout_saves_a_one_byte_bool_mask(device):
    x = torch.randn(32, 16, device=device, requires_grad=True)
    with SavedTensorRecorder() as rec:
        y, mask = torch.native_dropout(x, 0.5, True)
    assert mask.dtype == torch.bool and mask.element_size() == 1
    assert [s.dtype for s in rec.storages] == [torch.bool]
    assert rec.total_bytes == x.numel()  # one byte per element, the input is not kept
    del y, mask


def test_two_modules_attribute_bytes_to_their_own_scope():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU())
    x = torch.randn(4, 16)
    with SavedTensorRecorder(exclude_modules=[model]) as rec:
        handles = rec.attach({"fc": model[0], "act": model[1]})
        y = model(x)
    for handle in handles:
        handle.remove()
    assert rec.bytes_by_scope() == {"fc": 4 * 16 * 4, "act": 4 * 32 * 4}
    assert rec.total_bytes == 4 * 16 * 4 + 4 * 32 * 4
    del y


def test_a_storage_saved_in_two_scopes_counts_once_in_the_first():
    x = torch.randn(10, requires_grad=True)
    with SavedTensorRecorder() as rec:
        with rec.scope("layer0"):
            a = F.gelu(x)
        with rec.scope("layer1"):
            b = x.sin()  # saves x again
        c = a.cos()
    assert rec.bytes_by_scope() == {"layer0": _nbytes(x), UNSCOPED: _nbytes(a)}
    del b, c


def test_explicitly_excluded_buffers_are_left_out():
    causal = torch.ones(8, 8, dtype=torch.bool).triu(1)
    scores = torch.randn(8, 8, requires_grad=True)
    with SavedTensorRecorder() as counted:
        y = scores.masked_fill(causal, float("-inf"))
    with SavedTensorRecorder(exclude_tensors=[causal]) as excluded:
        z = scores.masked_fill(causal, float("-inf"))
    assert counted.total_bytes == causal.numel()
    assert excluded.total_bytes == 0
    del y, z


def test_an_output_its_own_op_saves_is_freed_with_its_dropped_branch():
    """exp keeps its output: the recorder must not keep that output's graph alive through it."""
    x = torch.randn(1000, requires_grad=True)
    with SavedTensorRecorder() as rec:
        dropped = x.exp()
        del dropped
        kept = x.sin()  # keeps x
    assert rec.total_bytes == _nbytes(x) and rec.freed_bytes == _nbytes(x)
    del kept


def test_a_storage_freed_during_the_forward_is_not_kept_nor_confused_with_its_successor():
    leaf = torch.randn(1024, requires_grad=True)
    with SavedTensorRecorder() as rec:
        with rec.scope("discarded"):
            u = leaf * 2
            old_address = u.untyped_storage().data_ptr()
            v = u.sin()  # saves u
            del u, v  # the branch dies, and u's storage with it
        with rec.scope("kept"):
            # exp saves its output; a few of them make it likely one lands on u's old address
            kept = [(leaf * 2).exp() for _ in range(4)]
    # Dedupe by address alone would fold such an output into u's dead "discarded" record.
    assert rec.bytes_by_scope() == {"kept": 4 * _nbytes(leaf)}
    assert rec.freed_bytes == _nbytes(leaf)
    reused = any(t.untyped_storage().data_ptr() == old_address for t in kept)
    print(f"allocator reused the freed address: {reused}")
    del kept


def test_full_checkpoint_region_costs_only_its_input():
    lin = torch.nn.Linear(16, 64)
    x = torch.randn(4, 16, requires_grad=True)
    with SavedTensorRecorder(exclude_modules=[lin]) as rec:
        y = checkpoint(lambda t: F.gelu(lin(t)), x, use_reentrant=False)
    assert rec.total_bytes == _nbytes(x)
    y.sum().backward()  # backward after the recorder exits still works
    assert x.grad is not None


def test_totals_are_frozen_at_exit():
    x = torch.randn(100, requires_grad=True)
    with SavedTensorRecorder() as rec:
        y = F.gelu(x * 3)
    y.sum().backward()  # frees what was saved
    assert rec.total_bytes == _nbytes(x)


def test_device_peak_bytes_is_none_on_cpu():
    assert device_peak_bytes("cpu") is None
    reset_device_peak("cpu")  # a no-op, not an error


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_peak_bytes_on_cuda_sees_an_allocation():
    reset_device_peak("cuda")
    before = device_peak_bytes("cuda")
    x = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    assert device_peak_bytes("cuda") >= before + x.numel()
