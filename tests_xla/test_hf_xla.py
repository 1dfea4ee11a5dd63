"""transformers checkpoints in and out of a model on the XLA device (world size 1).

``save_hf_checkpoint`` cuts one graph per gather group (a decoder layer, the embedding, the
norm, the head), not one per parameter, and what it writes loads in ``transformers`` with the
same logits; ``load_hf_checkpoint`` copies each rank's slices into XLA parameters.
"""

from __future__ import annotations

import pytest
import torch
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import transformers

from neuron_ckpt.models import LlamaForCausalLM, load_hf_checkpoint, save_hf_checkpoint
from tests.helpers import rel_norm

from .helpers import TOL

pytestmark = pytest.mark.usefixtures("xla")

CONFIG = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
)  # fmt: skip


def _executions() -> int:
    xm.wait_device_ops()
    return (met.metric_data("ExecuteTime") or (0,))[0]


def test_export_on_xla_loads_in_transformers_and_back(xla, tmp_path):
    config = transformers.LlamaConfig(**CONFIG)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(xla.device)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    ours = model(ids.to(xla.device), return_logits="full").logits.cpu()  # [b, s, v], as transformers

    before = _executions()
    save_hf_checkpoint(model, tmp_path / "hf", config, max_shard_size="20KB")
    groups = 3 + CONFIG["num_hidden_layers"]  # embedding, layers, final norm, LM head
    assert _executions() - before <= groups  # a graph per group at most, never one per parameter
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1  # sharded, with an index

    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        theirs = hf(ids).logits
    assert rel_norm(ours, theirs) < TOL, rel_norm(ours, theirs)  # fp32, XLA:CPU vs eager: summation order only

    torch.manual_seed(1)  # other weights, replaced by the checkpoint's
    again = LlamaForCausalLM(config).to(xla.device)
    load_hf_checkpoint(again, tmp_path / "hf")
    for (name, p), q in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(p.cpu(), q.cpu()), name
