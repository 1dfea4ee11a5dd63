"""Which of transformers' experts implementations runs on XLA (torch-xla 2.9, XLA:CPU), and the
one-line refusal of the one that does not (neuron_ckpt/recompute/xla_experts.py).

transformers' default, ``grouped_mm``, fails there twice: its int32 ``torch.histc`` has no kernel
(torch-xla runs it on the CPU one, which has no integer version), and ``torch._grouped_mm`` on XLA
tensors crashes the process. ``apply_recompute`` therefore refuses a model on XLA set to it and
names ``batched_mm``, which lowers (test_moe_recompute_xla.py trains with it). The facts behind
the refusal are asserted as they are, so the day torch-xla or transformers changes them a test
here fails and says the refusal is due for review. The load-balancing loss counts with the same
int32 ``histc`` unless the step passes an attention mask.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
import torch_xla
import transformers

from neuron_ckpt.recompute import Recompute, RecomputeConfig, apply_recompute

pytestmark = pytest.mark.usefixtures("xla")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HISTC = "\"histogram_cpu\" not implemented for 'Int'"


def tiny_mixtral(device, experts: str | None = None):
    """Tiny Mixtral on ``device``; ``experts`` None keeps transformers' default implementation."""
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
        use_cache=False, output_router_logits=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).train().to(device)
    if experts is not None:
        model.set_experts_implementation(experts)
    return model


def _selective_moe() -> RecomputeConfig:
    return RecomputeConfig(granularity="selective", modules=["moe"])


def test_grouped_mm_on_xla_is_refused_in_one_line_before_anything_changes(xla):
    model = tiny_mixtral(xla.device)
    assert model.config._experts_implementation == "grouped_mm"  # transformers' default
    with pytest.raises(ValueError) as error:
        apply_recompute(model, _selective_moe())
    message = str(error.value)
    assert "\n" not in message and "model.layers.0.mlp.experts (MixtralExperts)" in message, message
    assert "set_experts_implementation('batched_mm')" in message, message
    assert not any(isinstance(m, Recompute) for m in model.modules())

    model.set_experts_implementation("batched_mm")
    assert apply_recompute(model, _selective_moe()) == ["0.mlp", "1.mlp"]
    # The same model on the CPU, where grouped_mm runs, is not refused.
    assert apply_recompute(tiny_mixtral("cpu"), _selective_moe()) == ["0.mlp", "1.mlp"]


def test_why_grouped_mm_is_refused_on_xla(tmp_path):
    """In a fresh process, since the second failure is a crash: transformers' grouped_mm forward
    raises at its int32 histc, and torch._grouped_mm on XLA tensors dies of SIGSEGV."""
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-m", "tests_xla_hf5.grouped_mm_probe"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    lines = [line for line in out.stdout.splitlines() if line.startswith(("forward:", "_grouped_mm:"))]
    assert lines == [f"forward: NotImplementedError: {HISTC}"], (lines, out.stderr[-3000:])
    assert out.returncode == -signal.SIGSEGV, (out.returncode, out.stderr[-3000:])


def test_the_aux_loss_needs_an_attention_mask_on_xla(xla):
    model = tiny_mixtral(xla.device, "batched_mm")
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1)).to(xla.device)
    with pytest.raises(NotImplementedError, match=HISTC):  # load_balancing_loss_func's int32 histc
        model(input_ids=ids, labels=ids)
    out = model(input_ids=ids, labels=ids, attention_mask=torch.ones_like(ids))  # counts with scatter_add_
    torch_xla.sync()
    assert torch.isfinite(out.aux_loss.cpu()) and out.aux_loss.cpu() > 0
