"""The parity table of tensor parallel on transformers models (issue #27), from the test that asserts it.

For each family (tiny configs built in ``tests/test_hf_tensor_parallel.py``: Llama, Mistral, Qwen2,
Qwen3, Gemma2, Phi-3) and recompute preset, the model split by its own plan at TP 2 on gloo
against the dense model: loss difference, logits and worst gradient as max-abs difference over
the reference's max magnitude (fp32). ``tests/test_hf_tensor_parallel.py`` asserts every cell is
below 1e-5::

    python scripts/hf_tp_parity_table.py            # loss_parallel (logits split over the vocabulary)
    python scripts/hf_tp_parity_table.py --as-written  # the plan's own colwise_gather_output LM head

``--moe``: the mixture-of-experts families instead (issue #35; tiny configs of
``tests/test_hf_moe_tensor_parallel.py``: Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE, DeepSeek-V3/V2,
Aria, Llama 4, GPT-OSS), each under every experts implementation transformers offers it (Llama
4's experts have only their own forward), with the router's load-balancing loss as well (none
for DeepSeek, Aria and Llama 4: transformers returns their router logits only). The test asserts
its cases below 1e-5 too.

``--sequence-parallel``: TP 2 with sequence parallel (issue #35; ``tests/test_hf_sequence_parallel.py``,
dense and MoE families, each under recompute presets and module sets): loss, aux loss, logits and
worst gradient against the dense model, asserted below 1e-5 by that test.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: its tests package

from neuron_ckpt.distributed.local import LocalWorld
from tests import test_hf_moe_tensor_parallel as moe
from tests import test_hf_sequence_parallel as sp
from tests.test_hf_tensor_parallel import FAMILIES, PRESETS, _parity

EXPERTS = ("grouped_mm", "eager", "batched_mm")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--as-written", action="store_true", help="keep the LM head's gathered logits (no loss_parallel)")
    p.add_argument("--moe", action="store_true", help="the mixture-of-experts families, per experts implementation")
    p.add_argument("--sequence-parallel", action="store_true", help="TP 2 + sequence parallel, dense and MoE families")
    a = p.parse_args(argv)
    if a.moe:
        return moe_table()
    if a.sequence_parallel:
        return sequence_parallel_table()
    print("| family | preset | loss abs diff | logits rel | worst gradient rel (parameter) |")
    print("|---|---|---:|---:|---|")
    with LocalWorld(2) as world:
        for family in FAMILIES:
            for preset in PRESETS:
                r = max(world.run(_parity, family, preset, not a.as_written), key=lambda r: r["grad"])
                print(f"| {family} | {preset} | {r['loss']:.1e} | {r['logits']:.1e} | {r['grad']:.1e} ({r['worst']}) |")


def moe_table() -> None:
    print(
        "| family | experts | loss abs diff | aux loss abs diff | logits rel | worst gradient rel (parameter) "
        "| experts' weights gradient rel | router gradient rel |"
    )
    print("|---|---|---:|---:|---:|---|---:|---:|")
    with LocalWorld(2) as world:
        for family in moe.FAMILIES:
            for experts in ("own",) if family == "llama4" else EXPERTS:
                r = max(world.run(moe._parity, family, experts), key=lambda r: r["grad"])
                aux = "none" if r["aux"] is None else f"{r['aux']:.1e}"
                print(f"| {family} | {experts} | {r['loss']:.1e} | {aux} | {r['logits']:.1e} | {r['grad']:.1e} "
                      f"({r['worst']}) | {r['experts']:.1e} | {r['router']:.1e} |")  # fmt: skip


def sequence_parallel_table() -> None:
    print("| family | recompute | loss abs diff | aux loss abs diff | logits rel | worst gradient rel (parameter) |")
    print("|---|---|---:|---:|---:|---|")
    with LocalWorld(2) as world:
        for family, recompute in sp.CASES:
            r = max(world.run(sp._parity, family, recompute), key=lambda r: r["grad"])
            aux = "none" if r["aux"] is None else f"{r['aux']:.1e}"
            name = recompute if isinstance(recompute, str) else "+".join(recompute)
            print(
                f"| {family} | {name} | {r['loss']:.1e} | {aux} | {r['logits']:.1e} | {r['grad']:.1e} ({r['worst']}) |"
            )


if __name__ == "__main__":
    main()
