"""The Neuron runtime's own memory reports, which need no profiler: the OOM table and the per-NEFF load log.

The two AWS samples below are the documented ones (``neuron-runtime/explore/device-memory.rst``,
page dated 2025-10-16: an OOM on a trn2 at LNC=1, whose NC 4 and NC 5 share an HBM; and a load
log), as a log holds them: without the page's indentation, the OOM table between the runtime's
ERROR lines and its NEFF mapping. Every other input is **hand-made** in their shape. Expected
figures are the printed ones in binary units, worked out here by hand.
"""

from __future__ import annotations

import json

import pytest

from neuron_ckpt.memory.readers import CONTIGUOUS_PAGE_BYTES, ReadError, load_log, oom_table
from neuron_ckpt.memory.readers.detect import source_of
from neuron_ckpt.memory.readers.printed import printed_bytes

from .helpers import neuron_ckpt_cli

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30

AWS_OOM = r"""2025-May-15 20:58:33.895937 224822:224822 ERROR  TDRV:print_lnc_hbm_details                   LNC size is 1. Neuron Cores using this HBM: NC 4 and NC 5
2025-May-15 20:58:33.897479 224822:224822 ERROR  TDRV:log_dev_mem                             Failed to allocate 4.000GB (alignment: none, usage: tensors) on ND 0:NC 4
2025-May-15 20:58:33.899416 224822:224822 ERROR  TDRV:log_dev_mem_usage_table                 Displaying Current Memory Utilization:
(NOTE: the lines are LONG, and NEFF id to name mapping is printed after)

              |          |  Model   |  Model   |          |  Shared  |          |          |DMA Rings |DMA Rings | DMA Rings |DMA Rings |           |          | Profiler |
              |  TOTAL   |   Code   |Constants | Tensors  |Scratchpad|Scratchpad| Runtime  |    IO    |  Spill   |Collectives| Runtime  |Collectives|  XT CC   | Buffers  |
ND 0 Overall  | 20.188GB |192.102MB | 82.344KB | 20.000GB |  0.000B  |  0.000B  |350.125KB |179.000KB | 64.000KB |  0.000B   | 68.000KB |  0.000B   |  0.000B  |  0.000B  |
\_NC 4        | 20.094GB | 96.065MB | 58.344KB | 20.000GB |  0.000B  |  0.000B  |229.062KB |118.000KB | 48.000KB |  0.000B   | 36.000KB |  0.000B   |  0.000B  |  0.000B  |
  \_NEFF 1001 |263.906KB | 28.562KB | 34.344KB |   n/a    |   n/a    |  0.000B  |108.000KB | 57.000KB | 32.000KB |  0.000B   | 4.000KB  |  0.000B   |   n/a    |   n/a    |
  \_NEFF 1002 |244.875KB | 31.875KB | 24.000KB |   n/a    |   n/a    |  0.000B  |108.000KB | 61.000KB | 16.000KB |  0.000B   | 4.000KB  |  0.000B   |   n/a    |   n/a    |
\_NC 5        | 96.285MB | 96.037MB | 24.000KB |  0.000B  |  0.000B  |  0.000B  |121.062KB | 61.000KB | 16.000KB |  0.000B   | 32.000KB |  0.000B   |  0.000B  |  0.000B  |
  \_NEFF 1003 |244.875KB | 31.875KB | 24.000KB |   n/a    |   n/a    |  0.000B  |108.000KB | 61.000KB | 16.000KB |  0.000B   | 4.000KB  |  0.000B   |   n/a    |   n/a    |

NEFF id to name mapping:
1001: "1.0.41235.0+df4a714bb-/local/out-test0_meta_dense"
1002: "1.0.41235.0+df4a714bb-/local/out-test0_meta_concat3"
1003: "1.0.41235.0+df4a714bb-/local/out-test0_meta_concat3"
"""  # noqa: E501  the runtime's lines verbatim, as AWS prints them

AWS_LOAD = """2025-May-15 07:41:15.014997 2198754:2198754  INFO  TDRV:dml_log_dev_neff_mem
[ND 0:NC 0] Current Usage Total: 96.543MB
        shared scratchpad: 0.000B
Per NEFF memory usage breakdown for [out-test0_meta_concat3]:
        Total: 230.562KB
        * model code: 30.562KB
        * model constants: 24.000KB
        * scratchpad: 0.000B
        * runtime: 95.000KB
        * dma rings io: 61.000KB
        * dma rings spill: 16.000KB
        * dma rings collectives: 0.000B
        * dma rings runtime: 4.000KB
        * collectives: 0.000B
"""


def _write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _one_line_error(read, path, message: str) -> None:
    with pytest.raises(ReadError) as exc:
        read(path)
    text = str(exc.value)
    assert message in text and str(path) in text and "\n" not in text, text


def test_sizes_are_binary_and_carry_their_rounding():
    assert printed_bytes("20.188GB", "x") == (round(20.188 * GIB), GIB // 1000)
    assert printed_bytes("82.344KB", "x") == (round(82.344 * KIB), 1)
    assert printed_bytes("0.000B", "x") == (0, 1)
    with pytest.raises(ReadError, match="'12 MB' is not a size like 20.188GB"):
        printed_bytes("12 MB", "x")


def test_the_oom_table_of_awss_page(tmp_path):
    path = _write(tmp_path, "stderr.log", AWS_OOM)
    assert source_of(path) == "oom_table"
    _one_line_error(oom_table.read, path, "NC 4 on ND 0, but cores_per_device is 2")  # trn1's; this is a trn2
    reading = oom_table.read(path, cores_per_device=8)  # trn2 at LNC=1
    assert (reading.source, reading.kind, reading.samples, sorted(reading.cores)) == (
        "neuron-oom-table",
        "current",
        1,
        [4, 5],
    )
    nc4 = reading.core(4)
    assert (
        nc4["total"] == round(20.094 * GIB) and nc4["tensors"] == 20 * GIB and nc4["model_code"] == round(96.065 * MIB)
    )
    assert nc4["shared_scratchpad"] == nc4["scratchpad"] == 0 and nc4["dma_rings_collectives"] == 0
    assert nc4["runtime"] == round(229.062 * KIB) and nc4["xt_cc"] == nc4["profiler_buffers"] == 0
    assert nc4["neff_model_code"] == round(31.875 * KIB) and nc4["neff_runtime"] == 108 * KIB  # the largest NEFF's
    assert "neff_tensors" not in nc4 and reading.core(5)["neff_dma_rings_io"] == 61 * KIB  # n/a: not a figure


def _trn1_table(shared: str, tensors: str, label: str = "ND 12 HBM 1") -> str:
    """Hand-made: one trn1 core of device 12 that loaded two NEFFs (the newer ``HBM`` row label)."""
    head = AWS_OOM.split("\n\n")[1].splitlines()[:2]
    row = "| {} |192.102MB | 82.344KB | {} | {} |  0.000B  |350.125KB |179.000KB | 64.000KB |  0.000B   | 68.000KB |  0.000B   |  0.000B  |  0.000B  |"  # noqa: E501  a row as the runtime prints it
    return "\n".join(
        [
            *head,
            f"{label:<14}" + row.format("15.910GB", tensors, shared),
            "\\_NC 1        " + row.format("15.910GB", tensors, shared),
            "  \\_NEFF 1002 |282.648MB | 59.870MB | 24.000KB |   n/a    |   n/a    |282.648MB |108.000KB | 57.000KB | 32.000KB |  0.000B   | 4.000KB  |  0.000B   |   n/a    |   n/a    |",  # noqa: E501  a row as the runtime prints it
            "  \\_NEFF 1008 |370.354MB |182.810MB | 24.000KB |   n/a    |   n/a    |370.354MB |108.000KB | 57.000KB | 32.000KB |  0.000B   | 4.000KB  |  0.000B   |   n/a    |   n/a    |",  # noqa: E501  a row as the runtime prints it
            "",
            "NEFF id to name mapping:",
            "",
        ]
    )


def test_tables_in_one_log_give_the_largest_figure_and_the_page(tmp_path):
    path = _write(
        tmp_path,
        "neuron_mem_table_device_12_nc_1.log",
        _trn1_table("384.000MB", "12.000GB") + _trn1_table("384.000MB", "13.500GB"),
    )
    reading = oom_table.read(path)
    assert sorted(reading.cores) == [25] and reading.samples == 2  # device 12, core 1 on it
    assert reading.core(25)["tensors"] == round(13.5 * GIB) and reading.core(25)["shared_scratchpad"] == 384 * MIB
    assert reading.core(25)["neff_scratchpad"] == round(370.354 * MIB)  # the largest NEFF's need, exact
    assert reading.quantum == CONTIGUOUS_PAGE_BYTES and "64 MiB pages" in reading.notes[1]


@pytest.mark.parametrize(
    "text, message",
    [
        (
            (
                "              | TOTAL | Code | Constants | Tensors | Scratchpad |\n"
                "ND 0 HBM 0    | 1.0GB | 1.0MB | 0.0B | 1.0GB | 0.0B |\n"
            ),
            "an OOM table without shared_scratchpad",
        ),
        (_trn1_table("n/a", "12.000GB"), "NC 1's shared_scratchpad is n/a"),
        (
            "\n".join(line for line in _trn1_table("1.0GB", "1.0GB").splitlines() if not line.startswith("ND")),
            "'\\\\_NC 1' comes before any 'ND <d>' row",
        ),
        ("ERROR TDRV:log_dev_mem Failed to allocate 4.000GB\n", "no OOM table with NeuronCore rows"),
    ],
)
def test_oom_table_errors_are_one_line_naming_the_file(tmp_path, text, message):
    _one_line_error(oom_table.read, _write(tmp_path, "table.log", text), message)


def test_the_load_log_of_awss_page(tmp_path):
    path = _write(tmp_path, "rank0.log", AWS_LOAD)
    assert source_of(path) == "load_log"
    reading = load_log.read(path)
    assert (reading.source, reading.kind, reading.samples, reading.quantum) == ("neuron-load-log", "peak", 1, 1)
    assert reading.cores == {
        0: {
            "current_total": round(96.543 * MIB),
            "shared_scratchpad": 0,
            "neff_total": round(230.562 * KIB),
            "neff_model_code": round(30.562 * KIB),
            "neff_model_constants": 24 * KIB,
            "neff_scratchpad": 0,
            "neff_runtime": 95 * KIB,
            "neff_dma_rings_io": 61 * KIB,
            "neff_dma_rings_spill": 16 * KIB,
            "neff_dma_rings_collectives": 0,
            "neff_dma_rings_runtime": 4 * KIB,
            "neff_collectives": 0,
        }
    }


def _load(nc: int, scratchpad: str, name: str = "step", device: int = 3) -> str:
    """A hand-made load block in the AWS sample's form, between other INFO lines."""
    return (
        AWS_LOAD.replace("[ND 0:NC 0]", f"[ND {device}:NC {nc}]")
        .replace("scratchpad: 0.000B\n        * runtime", f"scratchpad: {scratchpad}\n        * runtime")
        .replace("out-test0_meta_concat3", name)
        + "2025-May-15 07:41:16.000001 2198754:2198754  INFO  NRT:nrt_load  done\n"
    )


def test_each_core_keeps_its_largest_neffs_figures(tmp_path):
    text = (
        _load(0, "282.648MB", "optimizer") + _load(1, "1.250GB") + _load(0, "370.354MB") + _load(1, "12.000KB", "init")
    )
    reading = load_log.read(_write(tmp_path, "ranks.log", text))
    assert sorted(reading.cores) == [6, 7] and reading.samples == 4  # device 3: cores 6 and 7
    assert reading.core(6)["neff_scratchpad"] == round(370.354 * MIB)
    assert reading.core(7)["neff_scratchpad"] == round(1.25 * GIB)
    assert reading.quantum == GIB // 1000  # core 7's largest figure is printed in GB: 1/1000 of one


@pytest.mark.parametrize(
    "text, message",
    [
        (AWS_LOAD.replace("        * scratchpad: 0.000B\n", ""), "the load block of NC 0 lacks neff_scratchpad"),
        (
            AWS_LOAD.split("Per NEFF")[0] + AWS_LOAD,
            "the load block of NC 0 lacks neff_total, neff_scratchpad before line 5",
        ),
        (
            "\n".join(AWS_LOAD.splitlines()[3:]),
            "a per-NEFF breakdown with no '[ND <d>:NC <n>] Current Usage Total' line",
        ),
        (AWS_LOAD.replace("96.543MB", "96.5 MB"), "Current Usage Total: '96.5' is not a size"),
        ("INFO nothing to see\n", "no per-NEFF load block"),
    ],
)
def test_load_log_errors_are_one_line_naming_the_file(tmp_path, text, message):
    _one_line_error(load_log.read, _write(tmp_path, "bad.log", text), message)


def test_compare_reads_load_logs_as_the_step_neffs_exact_scratchpad(capsys, tmp_path):
    """Llama-2 7B, TP 8, flash: the step NEFF's scratchpad at 4 and 8 layers is the model's per-layer
    bytes over a base, as the log prints it (in GB, three decimals): compare agrees within that rounding."""
    from neuron_ckpt.memory import ModelShape, TrainingSetup
    from neuron_ckpt.memory.compare import predicted_per_layer
    from neuron_ckpt.models import load_llama_config

    model = ModelShape.from_llama(load_llama_config("llama2-7b"))
    per_layer = predicted_per_layer(model, TrainingSetup(4096, 1, tp=8, attention="flash"), "none", "neuron-load-log")
    runs = []
    for layers in (4, 8):
        text = "".join(_load(nc, f"{(GIB + layers * per_layer) / GIB:.3f}GB", device=0) for nc in (0, 1))
        runs.append(f"--run={layers}={_write(tmp_path, f'L{layers}.log', _load(0, '12.000KB', 'init') + text)}")
    code, out, err = neuron_ckpt_cli(
        capsys, "compare", "--config", "llama2-7b", "--tp", "8", "--seq", "4096", "--json", *runs
    )
    assert code == 0, err
    result = json.loads(out)
    assert result["source"] == "neuron-load-log" and result["agrees"] and result["quantum"] == GIB // 1000
    assert (
        abs(result["measured_bytes_per_layer"] - per_layer) <= result["uncertainty_bytes_per_layer"] <= GIB / 1000 / 2
    )
