"""The table of expert parallelism against EP 1 (issue #44), from the test that asserts it.

For each MoE family of ``tests/test_expert_parallel.py`` (tiny configs: 4 experts, top 2, 2
layers; Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3, GPT-OSS) and each layout (EP 2 and EP 4
at TP 1 on DP 4, EP 2 at TP 2 + sequence parallel on DP 2), three ZeRO-1 AdamW steps with clipping
on 4 gloo processes against EP 1 at the same TP on the same data: the largest relative difference
over the steps of the loss, the aux loss (DeepSeek-V3 has none) and the pre-clip gradient norm.
The test asserts every cell below 1e-5::

    python scripts/ep_parity_table.py                      # the default dispatch: dropless all-to-all
    python scripts/ep_parity_table.py --form all_gather    # XLA's form, dropless, run on gloo
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: its tests package

from neuron_ckpt.distributed.local import LocalWorld
from tests.test_expert_parallel import FAMILIES, LAYOUTS, _relative, _train


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--form", default="all_to_all", choices=["all_to_all", "all_gather"])
    p.add_argument("--experts", default="grouped_mm", choices=["grouped_mm", "eager", "batched_mm"])
    a = p.parse_args(argv)
    print(f"dispatch {a.form}, experts {a.experts}; largest relative difference to EP 1 over 3 steps (worst rank)")
    print("| family | layout | loss | aux loss | gradient norm |")
    print("| --- | --- | ---: | ---: | ---: |")
    with LocalWorld(4) as world:
        for family in FAMILIES:
            for tp, ep, sp in LAYOUTS:
                base = world.run(_train, family, tp, 1, sp, a.experts)[0]
                spread = world.run(_train, family, tp, ep, sp, a.experts, a.form)
                cells = [max(_relative(r[k], base[k]) for r in spread) for k in ("loss", "aux", "norm")]
                aux = "none" if not base["aux"] else f"{cells[1]:.1e}"
                layout = f"EP {ep}, TP {tp}" + (" + SP" if sp else "")
                print(f"| {family} | {layout} | {cells[0]:.1e} | {aux} | {cells[2]:.1e} |", flush=True)


if __name__ == "__main__":
    main()
