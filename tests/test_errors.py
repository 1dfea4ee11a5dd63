"""Bad input is refused at construction (or at the first forward for runtime shapes) with a
ValueError whose message names the argument and what is allowed."""

from __future__ import annotations

import pytest
import torch

import neuron_ckpt as nc
from neuron_ckpt.parallel import (
    ColumnParallelLinear,
    CoreAttention,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)


def _raises(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "<no error>"


def _bad_sizes_at_t2() -> dict[str, str]:
    nc.initialize_model_parallel(2)
    x3 = torch.randn(3, 2, 8)  # sequence length 3: not divisible by t=2
    return {
        "column out_features": _raises(lambda: ColumnParallelLinear(8, 7)),
        "row in_features": _raises(lambda: RowParallelLinear(7, 8)),
        "embedding num_embeddings": _raises(lambda: VocabParallelEmbedding(11, 8)),
        "qkv num_heads": _raises(lambda: QKVParallelLinear(24, 3, 3)),
        "qkv num_kv_heads": _raises(lambda: QKVParallelLinear(32, 4, 3, head_dim=8)),
        "qkv hidden/heads": _raises(lambda: QKVParallelLinear(10, 4, 4)),
        "row sequence": _raises(lambda: RowParallelLinear(8, 8, sequence_parallel=True)(x3[..., :4])),
        "embedding sequence": _raises(
            lambda: VocabParallelEmbedding(8, 4, sequence_parallel=True)(torch.zeros(3, 2, dtype=torch.long))
        ),
        "row sp needs parallel input": _raises(
            lambda: RowParallelLinear(8, 8, input_is_parallel=False, sequence_parallel=True)
        ),
        "negative features": _raises(lambda: ColumnParallelLinear(-4, 8)),
        "cross entropy reduction": _raises(
            lambda: vocab_parallel_cross_entropy(torch.randn(2, 4), torch.zeros(2, dtype=torch.long), reduction="avg")
        ),
        "cross entropy shape": _raises(
            lambda: vocab_parallel_cross_entropy(torch.randn(2, 4), torch.zeros(3, dtype=torch.long))
        ),
        "tp does not divide world": _raises(lambda: _reinit(3)),
    }


def _reinit(t: int) -> None:
    nc.destroy_model_parallel()
    nc.initialize_model_parallel(t)


EXPECTED = {
    "column out_features": ["out_features=7", "tensor-parallel size 2"],
    "row in_features": ["in_features=7", "2"],
    "embedding num_embeddings": ["num_embeddings=11"],
    "qkv num_heads": ["num_heads=3"],
    "qkv num_kv_heads": ["num_kv_heads=3"],
    "qkv hidden/heads": ["hidden_size=10", "num_heads=4", "head_dim"],
    "row sequence": ["sequence length 3", "sequence_parallel"],
    "embedding sequence": ["sequence length 3", "sequence_parallel"],
    "row sp needs parallel input": ["input_is_parallel"],
    "negative features": ["in_features", "positive"],
    "cross entropy reduction": ["reduction", "'mean'"],
    "cross entropy shape": ["target shape"],
    "tp does not divide world": ["tensor_parallel_size=3", "world size 4", "allowed"],
}


def test_bad_sizes_raise_value_errors_naming_the_argument(world):
    messages = world(4).run(_bad_sizes_at_t2)[0]
    for case, needles in EXPECTED.items():
        for needle in needles:
            assert needle in messages[case], f"{case}: {needle!r} not in {messages[case]!r}"


def _layers_before_init() -> dict[str, str]:
    nc.destroy_model_parallel()
    return {
        "column": _raises(lambda: ColumnParallelLinear(8, 8)),
        "qkv": _raises(lambda: QKVParallelLinear(8, 2)),
        "sp norm": _raises(lambda: RMSNorm(8, sequence_parallel=True)),
    }


def test_layers_used_before_initialisation_say_what_to_call(world):
    for case, msg in world(2).run(_layers_before_init)[0].items():
        assert "initialize_model_parallel" in msg and "parallel_state" in msg, f"{case}: {msg}"


def test_plain_norm_needs_no_parallel_state():
    nc.destroy_model_parallel()
    y = RMSNorm(8)(torch.randn(2, 8))
    assert y.shape == (2, 8)


def test_invalid_tensor_parallel_size_type():
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive int"):
        nc.initialize_model_parallel(0)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(num_heads=4, num_kv_heads=3, head_dim=8), "num_kv_heads=3"),
        (dict(num_heads=4, num_kv_heads=4, head_dim=8, attention_dropout=1.0), "attention_dropout"),
        (dict(num_heads=4, num_kv_heads=4, head_dim=8, implementation="sdpa"), "implementation"),
        (dict(num_heads=0, num_kv_heads=4, head_dim=8), "num_heads"),
    ],
)
def test_core_attention_arguments(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        CoreAttention(**kwargs)
