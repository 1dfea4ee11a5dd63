"""Pipeline parallelism on torch-xla is refused in one line, before anything is built (docs/pipeline.md).

On the real XLA runtime (torch 2.9 + torch-xla 2.9, what trn1 trains with): ``LlamaPipeline``
raises at construction, and the tutorial's ``train.py --pp 2`` raises before it starts work. The
pipeline package itself imports under torch 2.9 (the trainer imports it on every backend), so a
trn1 run with ``--pp 1`` is untouched.
"""

from __future__ import annotations

import pytest
import transformers

from neuron_ckpt.distributed import runtime
from neuron_ckpt.pipeline import LlamaPipeline, PipelineConfig
from neuron_ckpt.pipeline.xla import XLA_REFUSAL
from tests.tutorial_run import tiny_run_files, train_error

pytestmark = pytest.mark.usefixtures("xla")


def test_llama_pipeline_is_refused_on_xla():
    assert runtime.is_xla()
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    with pytest.raises(ValueError) as info:
        LlamaPipeline(config, PipelineConfig("GPipe", 1), 1, 8)
    assert str(info.value) == XLA_REFUSAL and "aws-neuron-sdk#1189" in XLA_REFUSAL


def test_train_pp2_is_refused_on_xla_in_one_line(tmp_path):
    message = train_error(tiny_run_files(tmp_path) + ["--pp", "2", "--max-steps", "1"])
    assert XLA_REFUSAL in message and "\n" not in message
