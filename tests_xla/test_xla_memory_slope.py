"""scripts/xla_memory_slope.py on XLA:CPU: XLA's buffer assignment of a Llama training step, per layer.

One run of the script (layers 1 and 2, every recompute preset, bf16, in its own process: XLA_FLAGS
must be set before XLA starts) into a capture directory; then what the compiler keeps per decoder
layer (the difference between the two layer counts, exact integers), checked against the analytic
model term by term. The facts below were measured with torch-xla 2.9 and explained from the
optimised HLO and the buffer assignment (each assert says which buffers); a change in XLA:CPU or
torch-xla that changes what is kept fails here, with the numbers.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from neuron_ckpt.memory import ModelShape, TrainingSetup, layer_activation_bytes
from neuron_ckpt.memory.capture import read_capture
from neuron_ckpt.memory.readers import xla_buffers
from neuron_ckpt.models import load_llama_config
from neuron_ckpt.recompute import PRESETS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = (1, 2)
S, F32 = 256, 4


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    out = tmp_path_factory.mktemp("xla_capture") / "capture"
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "xla_memory_slope.py"), "--out", str(out),
         "--layers", ",".join(map(str, LAYERS)), "--dtype", "bf16"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, done.stdout


def _per_layer(out, cap, preset: str) -> dict[str, int]:
    """Bytes one more layer adds, by category (two layer counts one apart: a difference)."""
    one, two = (
        xla_buffers.read(out / r.files["xla_buffers"]).core(0)
        for n in LAYERS
        for r in cap.runs
        if (r.layers, r.recompute) == (n, preset)
    )
    return {k: two[k] - one[k] for k in one}


def test_the_capture_reads_back(capture):
    out, stdout = capture
    cap = read_capture(out)
    assert cap.job == {
        "model": "llama",
        "config": "config.json",
        "tp": 1,
        "dp": 1,
        "seq": S,
        "micro_batch": 1,
        "dtype": "bf16",
        "sequence_parallel": False,
        "zero1": False,
        "attention": "explicit",
    }
    runs = [(r.recompute, r.layers, r.attention) for r in cap.runs]
    assert runs == [(p, n, "explicit") for p in PRESETS for n in LAYERS]
    assert any("flash attention not captured" in n for n in cap.notes)
    assert load_llama_config(out / "config.json").hidden_size == 128
    assert stdout.count(" OK ") == len(PRESETS) and "FAIL" not in stdout, stdout


def test_the_compiler_per_layer_against_the_analytic_model(capture):
    out, _ = capture
    cap = read_capture(out)
    model = ModelShape.from_llama(load_llama_config(out / "config.json"))
    setup = TrainingSetup(
        seq_len=S, micro_batch=1, tp=1, dtype="bf16", sequence_parallel=False, zero1=False, attention="explicit"
    )
    h, f, a = model.hidden, model.ffn, model.heads
    one, two = (dataclasses.replace(model, layers=n).local_parameters() for n in (1, 2))
    weights = (two - one) * setup.width
    norms = 2 * h * setup.width  # the two RMSNorm weights; every other weight of a layer is a matrix
    matrices = weights - norms
    got = {p: _per_layer(out, cap, p) for p in PRESETS}
    kept = {p: got[p]["live_at_peak"] - got[p]["parameters"] for p in PRESETS}  # live at the peak, less weights

    for p in PRESETS:
        # The control: the graph's parameters grow by exactly one layer's weights.
        assert got[p]["parameters"] == weights, (p, got[p])
        # Outputs: the gradients, plus the transposed base of every matrix gradient (torch-xla's
        # `.grad` of a linear weight is a permute of an mm, and the lazy tensor syncs base and view),
        # plus 8 B per output in the result tuple: 16 per layer; full adds the 9 weights its
        # optimization barrier rewrote in place (outputs aliased to the parameters, no copy), the
        # output-discarding norms their 2 weights.
        pointers = 8 * (16 + {"full": 9, "selective+mlp_act+norm": 2}.get(p, 0))
        assert got[p]["outputs"] == weights + matrices + pointers, (p, got[p])
        # The temp buffer holds what is live at the peak less what XLA packed into the gradients'
        # output buffers (not yet written at the forward/backward boundary): measured 94-95 %.
        assert 0.9 * kept[p] <= got[p]["temp"] <= kept[p], (p, got[p]["temp"], kept[p])

    # No recompute: the analytic layer, every tensor widened to fp32 (XLA:CPU computes bf16 in f32
    # and keeps f32 buffers, rounding through convert pairs inside fusions), plus what XLA keeps
    # that the model does not: a second fp32 [a, s, s] (the unrounded softmax the backward fusions
    # read, beside the bf16-rounded probabilities the P@V dot reads), sigmoid(gate) and
    # silu(gate) (the fused SwiGLU's backward recomputes them; CSE reuses the forward's instead),
    # and an fp32 copy of every weight matrix (the dots' operands, converted once for forward and
    # backward).
    fp32 = layer_activation_bytes(model, dataclasses.replace(setup, dtype="fp32"), "none")
    assert kept["none"] == fp32 + F32 * a * S * S + 2 * F32 * S * f + 2 * matrices, kept
    # Selective recompute keeps exactly as much: XLA:CPU strips the optimization barrier before
    # scheduling, and the scheduler puts the recomputed QK^T and softmax in the forward, next to
    # the originals, so the recomputed probabilities live across the peak as the saved ones would.
    assert kept["selective"] == kept["none"], kept
    # mlp_act drops one fp32 [s, f] (silu(gate) is no longer kept apart).
    assert kept["none"] - kept["selective+mlp_act"] == F32 * S * f, kept
    # Full recompute saves nothing more (the whole layer's recompute is scheduled in the forward);
    # its barrier's in-place parameters add copies of the two bf16 norm weights live at the peak.
    assert kept["full"] - kept["selective+mlp_act"] == norms, kept
    # Output-discarding norms save nothing on XLA:CPU either: with the barrier stripped, their
    # rerun is scheduled in the forward and the norms' outputs live across the peak as before.
    assert kept["selective+mlp_act+norm"] == kept["selective+mlp_act"], kept
    assert kept["full"] > 50 * layer_activation_bytes(model, setup, "full")
