"""The collectives return their result and leave their input as it was, on gloo as on XLA.

``dist.all_reduce`` works in place and ``xm.all_reduce`` returns a new tensor; the library's
:func:`~neuron_ckpt.distributed.collectives.all_reduce` is out of place on both, so a caller
never needs a ``.clone()`` to keep its tensor. A 2-rank gloo world checks every collective with a
contiguous and a non-contiguous input.
"""

from __future__ import annotations

import torch

import neuron_ckpt as nc
from neuron_ckpt.distributed import collectives as C


def _inputs(rank: int) -> dict[str, torch.Tensor]:
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6) + 100 * rank
    return {"contiguous": x, "transposed": x.t()}


def _collectives_keep_their_input() -> dict[str, bool]:
    st = nc.initialize_model_parallel(2)
    rank, ok = st.tp_rank, {}
    both = [_inputs(r) for r in range(2)]
    for name, x in _inputs(rank).items():
        before = x.clone()
        results = {
            "all_reduce sum": (C.all_reduce(x, st.tp), both[0][name] + both[1][name]),
            "all_reduce max": (C.all_reduce(x, st.tp, op="max"), torch.maximum(both[0][name], both[1][name])),
            "all_gather": (C.all_gather(x, 1, st.tp), torch.cat([both[0][name], both[1][name]], 1)),
            "reduce_scatter": (C.reduce_scatter(x, 0, st.tp), (both[0][name] + both[1][name]).chunk(2, 0)[rank]),
            "all_gather_start": (C.all_gather_start(x, st.tp).wait(), torch.cat([both[0][name], both[1][name]], 0)),
        }
        for op, (got, want) in results.items():
            ok[f"{op} {name}: right result"] = torch.equal(got, want)
            ok[f"{op} {name}: a new tensor"] = got.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
        ok[f"{name}: input unchanged"] = torch.equal(x, before)
    return ok


def test_collectives_return_a_new_tensor_and_leave_the_input_unchanged_on_gloo(world):
    for rank, ok in enumerate(world(2).run(_collectives_keep_their_input)):
        assert all(ok.values()), f"rank {rank}: failed {[k for k, v in ok.items() if not v]}"
