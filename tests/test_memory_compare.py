"""``neuron-ckpt compare``: the per-layer slope, its uncertainty, the control and the verdict.

The end-to-end check is real: a whole tiny ``LlamaForCausalLM`` run at 1, 2 and 3 layers, what
autograd keeps counted by our recorder, compared with the analytic model (exact bytes, so the
slope must equal the prediction to the byte). The trn1 capture under tests/fixtures/memory is
hand-made (its manifest says so): it exercises pages, cores, the control and the savings. So is the
trn1.32xlarge capture built here, in the shape public neuron-monitor output has for a job of many
processes (tests/neuron_reports.py): compare must read it and compare only the cores the job used.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

import neuron_ckpt as nc
from neuron_ckpt.memory import ModelShape, SavedTensorRecorder, TrainingSetup, layer_activation_bytes
from neuron_ckpt.memory.capture import Run, write_capture
from neuron_ckpt.memory.compare import fit_slope, layer_state_bytes, predicted_per_layer, predicted_saving
from neuron_ckpt.memory.readers import recorder
from neuron_ckpt.models import LlamaForCausalLM, load_llama_config
from neuron_ckpt.parallel import CoreAttention
from neuron_ckpt.recompute import RecomputeConfig, apply_recompute

from . import neuron_reports
from .helpers import neuron_ckpt_cli

FIXTURE = Path(__file__).parent / "fixtures" / "memory" / "trn1_7b_handmade"
TINY = Path(__file__).parents[1] / "tutorials" / "llama2_7b_tp_zero1" / "configs" / "tiny.json"
MIB, PAGE = 1 << 20, 512 << 20
S, B = 64, 2


# ---------------------------------------------------------------------------------------------
# The arithmetic.


def test_two_runs_k_layers_apart_are_uncertain_by_a_page_over_k():
    slope = fit_slope([(8, 3 * PAGE), (16, 5 * PAGE)], PAGE)
    assert slope.bytes_per_layer == 2 * PAGE / 8
    assert slope.uncertainty == pytest.approx(PAGE / 8) and slope.page_part == pytest.approx(PAGE / 8)


def test_three_layer_counts_add_the_fit_scatter():
    on_a_line = fit_slope([(1, 100), (2, 200), (3, 300)], None)
    assert (on_a_line.bytes_per_layer, on_a_line.uncertainty) == (100, 0)
    scattered = fit_slope([(1, 100), (2, 230), (3, 300)], None)
    assert scattered.bytes_per_layer == 100 and scattered.uncertainty > 0
    with pytest.raises(ValueError, match="two or more different layer counts"):
        fit_slope([(4, 1), (4, 2)], None)


def test_saving_is_kept_bytes_less_what_recompute_brings_back_at_the_peak():
    model = ModelShape.from_llama(load_llama_config(TINY))
    setup = TrainingSetup(S, B, attention="explicit", sequence_parallel=False, zero1=False)
    none, full, sel = (layer_activation_bytes(model, setup, p) for p in ("none", "full", "selective"))
    assert predicted_saving(model, setup, "none", "full", 4) == 4 * (none - full) - none
    assert predicted_saving(model, setup, "none", "full", 4, peak=False) == 4 * (none - full)
    assert predicted_saving(model, setup, "none", "selective", 4) == 4 * (none - sel) - (none - sel)


def test_layer_state_is_weights_gradients_master_and_moments_sharded_by_zero1():
    model = ModelShape.from_llama(load_llama_config("llama2-7b"))
    n = (4 * 4096 * 4096 + 3 * 4096 * 11008) // 8 + 2 * 4096  # one layer on one of 8 TP ranks
    setup = TrainingSetup(4096, 1, tp=8, dp=16)  # bf16, fp32 accumulation, fp32 master, ZeRO-1
    assert layer_state_bytes(model, setup, "weights") == 2 * n
    assert layer_state_bytes(model, setup) == round(n * (2 + 4) + 3 * 4 * n / 16)


# ---------------------------------------------------------------------------------------------
# End to end on what autograd really keeps.


def _recorded(layers: int, preset: str) -> int:
    config = dataclasses.replace(load_llama_config(TINY), num_hidden_layers=layers)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config, attention_implementation="explicit", dtype=torch.bfloat16).train()
    if preset != "none":
        apply_recompute(model, RecomputeConfig.preset(preset))
    masks = [m.causal_mask(S, torch.device("cpu")) for m in model.modules() if isinstance(m, CoreAttention)]
    ids = torch.randint(0, config.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    with SavedTensorRecorder(exclude_modules=[model], exclude_tensors=masks) as rec:
        loss = model(ids, labels=ids).loss
    loss.backward()
    return rec.total_bytes


def _record_all(root: str) -> dict:
    nc.initialize_model_parallel(1)
    runs = {}
    for layers, preset in [(1, "none"), (2, "none"), (3, "none"), (3, "full"), (3, "selective")]:
        path = Path(root) / f"{preset}_L{layers}.json"
        recorder.write(path, [_recorded(layers, preset)])
        runs[(layers, preset)] = str(path)
    return runs


@pytest.fixture(scope="module")
def recorded_runs(world, tmp_path_factory):
    return world(1).run(_record_all, str(tmp_path_factory.mktemp("recorded")))[0]


def test_recorded_llama_agrees_with_the_model_to_the_byte(capsys, recorded_runs):
    r = recorded_runs
    code, out, err = neuron_ckpt_cli(
        capsys,
        "compare",
        "--config",
        str(TINY),
        "--seq",
        str(S),
        "--micro-batch",
        str(B),
        "--no-sequence-parallel",
        "--no-zero1",
        "--attention",
        "explicit",
        "--run",
        f"1={r[1, 'none']}",
        "--run",
        f"2={r[2, 'none']}",
        "--run",
        f"3={r[3, 'none']}",
        "--recompute-run",
        f"full={r[3, 'full']}",
        "--recompute-run",
        f"selective={r[3, 'selective']}",
        "--json",
    )
    assert code == 0, err
    result = json.loads(out)
    assert result["source"] == "recorder" and result["agrees"] and result["resolved"]
    assert result["measured_bytes_per_layer"] == result["predicted_bytes_per_layer"]  # exact: no page, no scatter
    assert result["uncertainty_bytes_per_layer"] == 0 and result["verdict"].startswith("agrees")
    assert {s["preset"]: s["measured"] == s["predicted"] for s in result["savings"]} == {
        "full": True,
        "selective": True,
    }


def test_a_wrong_model_is_called_a_disagreement_with_its_size(capsys, recorded_runs):
    r = recorded_runs  # the same reports described as a longer sequence: the model predicts more
    code, out, _ = neuron_ckpt_cli(
        capsys,
        "compare",
        "--config",
        str(TINY),
        "--seq",
        str(2 * S),
        "--micro-batch",
        str(B),
        "--no-sequence-parallel",
        "--attention",
        "explicit",
        "--run",
        f"1={r[1, 'none']}",
        "--run",
        f"3={r[3, 'none']}",
    )
    assert code == 1
    verdict = [line for line in out.splitlines() if "verdict:" in line][0]
    assert "disagrees by -" in verdict and "%" in verdict


# ---------------------------------------------------------------------------------------------
# A hand-made trn1 capture: two NeuronCores, 512 MiB pages, a control, a saving.


def test_handmade_capture_reads_as_it_is(capsys):
    code, out, err = neuron_ckpt_cli(capsys, "compare", "--capture", str(FIXTURE))
    assert code == 1, err  # the hand-made NEFF keeps 70 MiB a layer against 64.3 predicted
    neff, sysfs = out.split("\nneff:")[1].split("\nsysfs:")
    assert "exact bytes, no page" in neff and "disagrees by +8.8%" in neff
    assert "page 512 MiB" in sysfs and "core 0" in sysfs and "core 1" in sysfs
    assert "control: tensors per layer" in sysfs and ": ok" in sysfs
    assert "unresolved" in sysfs and "layers apart would resolve it" in sysfs  # 64 MiB a layer, 512 MiB pages
    code, out, _ = neuron_ckpt_cli(capsys, "compare", "--capture", str(FIXTURE), "--json")
    result = json.loads(out)
    for key in (
        "predicted_bytes_per_layer",
        "measured_bytes_per_layer",
        "uncertainty_bytes_per_layer",
        "control",
        "agrees",
        "verdict",
    ):
        assert key in result, key
    assert result["source"] == "neff" and result["agrees"] is False and result["resolved"] is True
    by_source = {c["source"]: c for c in result["comparisons"]}
    assert by_source["sysfs"]["control"]["ok"] and by_source["sysfs"]["resolved"] is False
    assert by_source["sysfs"]["agrees"] and by_source["sysfs"]["savings"][0]["preset"] == "full"


def test_a_failing_control_says_the_method_is_broken(capsys, tmp_path):
    capture = tmp_path / "capture"
    shutil.copytree(FIXTURE, capture)
    bumped = capture / "none_L32" / "sysfs.json"  # one run holds 1 GiB more tensors than its layers explain
    data = json.loads(bumped.read_text())
    for core in data.values():
        core["tensors"] = {k: v + (1 << 30) for k, v in core["tensors"].items()}
    bumped.write_text(json.dumps(data))
    _, out, _ = neuron_ckpt_cli(capsys, "compare", "--capture", str(capture), "--source", "sysfs")
    assert "FAILS" in out and "the control fails" in out and "says nothing about the model" in out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--seq", "64", "--run", "1=a.json"], "no such file"),
        (["--seq", "64", "--run", "x=a.json", "--run", "2=b.json"], "LAYERS must be a positive integer"),
        (["--seq", "64"], "give --run LAYERS=PATH two or more times"),
        (["--run", "1=a", "--run", "2=b"], "--seq is required"),
        (["--capture", "."], "not a capture directory"),
        (["--capture", str(FIXTURE), "--tp", "4"], "--tp 4 differs from the capture's 8"),
        (["--capture", str(FIXTURE), "--source", "recorder"], "the capture has neff, sysfs"),
        (["--seq", "64", "--run", "1"], "expected LAYERS=PATH"),
    ],
)
def test_bad_input_is_one_line(capsys, tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    code, out, err = neuron_ckpt_cli(capsys, "compare", *argv)
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_one_layer_count_or_mixed_formats_are_refused(capsys, recorded_runs, tmp_path):
    r = recorded_runs
    sysfs = FIXTURE / "none_L8" / "sysfs.json"
    base = ["--config", str(TINY), "--seq", str(S), "--no-sequence-parallel", "--attention", "explicit"]
    code, _, err = neuron_ckpt_cli(capsys, "compare", *base, "--run", f"3={r[3, 'none']}", "--run", f"3={r[3, 'full']}")
    assert code == 2 and "two or more different layer counts" in err
    code, _, err = neuron_ckpt_cli(capsys, "compare", *base, "--run", f"1={r[1, 'none']}", "--run", f"2={sysfs}")
    assert code == 2 and "compare one format at a time" in err


# ---------------------------------------------------------------------------------------------
# neuron-monitor as a multi-process job writes it (tests/neuron_reports.py: every runtime lists all
# 32 NeuronCores of a trn1.32xlarge, zeros where it holds nothing, one shared tag, the vcpu error).

JOB = {
    "model": "llama",
    "config": "llama2-7b",
    "seq": 4096,
    "micro_batch": 1,
    "dtype": "bf16",
    "sequence_parallel": True,
    "zero1": True,
    "attention": "flash",
}
SCRATCH_BASE, TENSORS_BASE = 3 * PAGE, 6 << 30


def _monitor_capture(root: Path, tp: int, dp: int, cores_of, prometheus: bool = False) -> Path:
    """Runs at 8, 16 and 32 layers (none) and 32 (full), 3 samples each: the scratchpad the model
    predicts over a base, rounded up to 512 MiB pages; tensors growing by one layer's state.
    ``cores_of(layers)``: the NeuronCores that run's processes use."""
    model = ModelShape.from_llama(load_llama_config("llama2-7b"))
    setup = TrainingSetup(4096, 1, tp=tp, dp=dp, attention="flash")
    per_layer, state = predicted_per_layer(model, setup, "none", "neuron-monitor"), layer_state_bytes(model, setup)
    runs = []
    for layers, preset in [(8, "none"), (16, "none"), (32, "none"), (32, "full")]:
        scratch = SCRATCH_BASE + layers * per_layer
        if preset == "full":
            scratch -= predicted_saving(model, setup, "none", "full", layers)
        files, lines = {}, []
        for sample in range(3):  # the scratchpad stays, tensors move
            holds = neuron_reports.held(-(-scratch // PAGE) * PAGE, TENSORS_BASE + layers * state - (2 - sample) * MIB)
            lines.append(neuron_reports.report(neuron_reports.job(cores_of(layers), 32, holds)))
        (root / f"{preset}_L{layers}").mkdir(parents=True)
        files["neuron_monitor"] = f"{preset}_L{layers}/neuron-monitor.ndjson"
        neuron_reports.write_lines(root / files["neuron_monitor"], lines)
        if prometheus:  # the exporter needs a tag per process (neuron_reports: shared tags collapse)
            files["prometheus"] = f"{preset}_L{layers}/metrics.txt"
            scrapes = [
                neuron_reports.report(
                    neuron_reports.job(
                        cores_of(layers),
                        32,
                        neuron_reports.held(-(-scratch // PAGE) * PAGE, TENSORS_BASE + layers * state),
                        tag="neuron_ckpt_rank{rank}",
                    )
                )
            ]
            (root / files["prometheus"]).write_text("".join(map(neuron_reports.exposition, scrapes * 2)))
        runs.append(Run(layers, preset, "flash", files))
    write_capture(root, {**JOB, "tp": tp, "dp": dp}, runs)
    return root


@pytest.mark.parametrize(
    "tp, dp, cores", [(8, 1, range(8, 16)), (8, 4, range(32))], ids=["8-processes", "32-processes"]
)
def test_a_trn1_32xlarge_capture_compares_on_the_cores_the_job_used(capsys, tmp_path, tp, dp, cores):
    capture = _monitor_capture(tmp_path / "capture", tp, dp, lambda layers: cores, prometheus=tp * dp == 8)
    code, out, err = neuron_ckpt_cli(capsys, "compare", "--capture", str(capture), "--json")
    assert code == 0, err
    comparisons = json.loads(out)["comparisons"]
    assert [c["source"] for c in comparisons] == ["neuron-monitor"] + (["prometheus"] if tp * dp == 8 else [])
    model = ModelShape.from_llama(load_llama_config("llama2-7b"))
    setup = TrainingSetup(4096, 1, tp=tp, dp=dp, attention="flash")
    per_layer = predicted_per_layer(model, setup, "none", "neuron-monitor")
    pages = fit_slope([(n, -(-(SCRATCH_BASE + n * per_layer) // PAGE) * PAGE) for n in (8, 16, 32)], PAGE)
    assert sum("largest of 3 samples" in n for n in comparisons[0]["notes"]) == 1  # once for the runs alike
    for c in comparisons:
        assert sorted(map(int, c["per_core"])) == list(cores), c["source"]  # idle cores left out
        assert c["measured_bytes_per_layer"] == pytest.approx(pages.bytes_per_layer), c["source"]
        assert c["agrees"] and c["control"]["ok"] and c["control"]["predicted"] == layer_state_bytes(model, setup)
        assert c["savings"][0]["preset"] == "full" and c["savings"][0]["agrees"]


def test_runs_on_different_cores_are_refused(capsys, tmp_path):
    capture = _monitor_capture(tmp_path / "capture", 8, 1, lambda layers: range(8) if layers == 8 else range(8, 16))
    code, _, err = neuron_ckpt_cli(capsys, "compare", "--capture", str(capture))
    assert code == 2 and "NeuronCore 0 holds nothing there but does in other runs" in err and "none_L16" in err


# ---------------------------------------------------------------------------------------------
# Which reader a file needs.


def test_the_reader_is_picked_from_what_the_file_holds(tmp_path, recorded_runs):
    from neuron_ckpt.memory.readers.detect import read_any, source_of

    fixtures = FIXTURE.parent
    assert source_of(fixtures / "def.json") == "neff" and read_any(fixtures / "def.json").source == "neff"
    assert source_of(FIXTURE / "none_L8" / "sysfs.json") == "sysfs"
    assert source_of(recorded_runs[1, "none"]) == "recorder"
    (tmp_path / "nm.ndjson").write_text('{"neuron_runtime_data": []}\n{"neuron_runtime_data": []}\n')
    assert source_of(tmp_path / "nm.ndjson") == "neuron_monitor"
    (tmp_path / "stats.json").write_text('{"allocated_bytes.all.peak": 1}')
    assert source_of(tmp_path / "stats.json") == "cuda_stats"
    (tmp_path / "other.json").write_text('{"loss": 1.5}')
    (tmp_path / "notes.txt").write_text("loss went down\n")
    for path, message in [
        (tmp_path / "other.json", "JSON of no known report"),
        (tmp_path / "notes.txt", "not a memory report this tool reads"),
        (tmp_path, "neither an unpacked NEFF"),
    ]:
        with pytest.raises(ValueError, match=message):
            source_of(path)
