"""What a saved ZeRO-1 state must match to load: its layout version, and the layout it describes.

``Zero1Optimizer.state_dict()["meta"]`` records the layout the slices were cut in (the TP, DP,
PP, CP and EP sizes and ranks, and per flat its param group, whether it holds experts, dtypes,
parameter shapes, padding and bucket boundaries, with the bucket cap that made them). A state
loads only into an optimizer whose own record is the same; these functions say, field by field,
why another does not.
"""

from __future__ import annotations

from typing import Any

LAYOUT_VERSION = 2
"""``state_dict()["version"]``. Version 1 (one unbucketed flat buffer per param group and dtype,
no ``version`` key) existed only in development versions before bucketing and is not read."""


def refuse_other_version(state_dict: dict[str, Any]) -> None:
    """One-line ValueError for a state of a layout version this optimizer does not read."""
    version = state_dict.get("version", 1)  # version 1 had no "version" key
    if version != LAYOUT_VERSION:
        saved = "1 (before bucketing)" if version == 1 else repr(version)
        raise ValueError(
            f"Zero1Optimizer.load_state_dict: version: checkpoint {saved}, this optimizer reads "
            f"{LAYOUT_VERSION} only: start the optimizer state fresh, or load it with the neuron_ckpt "
            "version that wrote it"
        )


def layout_mismatches(saved: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """Human-readable ``field: checkpoint X, here Y`` for every difference between two metas."""
    # States saved before pipeline (context, expert) parallelism: one stage (no CP, no experts spread).
    absent = {"pp_size": 1, "pp_rank": 0, "cp_size": 1, "cp_rank": 0, "ep_size": 1, "ep_rank": 0}
    sizes = (
        "dp_size",
        "tp_size",
        "pp_size",
        "cp_size",
        "ep_size",
        "dp_rank",
        "tp_rank",
        "pp_rank",
        "cp_rank",
        "ep_rank",
    )
    out = [
        f"{k}: checkpoint {saved.get(k, absent.get(k))}, here {here[k]}"
        for k in sizes
        if saved.get(k, absent.get(k)) != here[k]
    ]
    a, b = saved.get("flats", []), here["flats"]
    if len(a) != len(b):
        out.append(f"number of flat buffers (param group x dtype): checkpoint {len(a)}, here {len(b)}")
        return out
    for i, (x, y) in enumerate(zip(a, b)):
        name = f"flats[{i}]"
        for k in ("group", "dtype", "padding", "expert"):
            if x.get(k, False) != y.get(k, False):  # "expert" absent: saved before expert parallelism
                out.append(f"{name}.{k}: checkpoint {x.get(k, False)}, here {y.get(k, False)}")
        if len(x["shapes"]) != len(y["shapes"]):
            out.append(f"{name} parameter count: checkpoint {len(x['shapes'])}, here {len(y['shapes'])}")
            continue
        shapes_differ = False
        for j, (sx, sy) in enumerate(zip(x["shapes"], y["shapes"])):
            if tuple(sx) != tuple(sy):
                shapes_differ = True
                out.append(f"{name} parameter {j} shape: checkpoint {tuple(sx)}, here {tuple(sy)}")
        bx, by = [tuple(t) for t in x["buckets"]], [tuple(t) for t in y["buckets"]]
        if bx != by and not shapes_differ:
            # Same parameters, different cuts: the cap, or the dtype it is counted in, changed.
            first = next((k for k, (u, v) in enumerate(zip(bx, by)) if u != v), min(len(bx), len(by)))
            out.append(
                f"{name}.buckets: checkpoint {len(bx)} (bucket_cap_mb={saved.get('bucket_cap_mb')}, reduced in "
                f"{x['reduce_dtype']}), here {len(by)} (bucket_cap_mb={here['bucket_cap_mb']}, reduced in "
                f"{y['reduce_dtype']}); first difference at bucket {first}: checkpoint "
                f"{bx[first] if first < len(bx) else None}, here {by[first] if first < len(by) else None}"
            )
    return out
