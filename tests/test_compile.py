"""``torch.compile`` of the tensor-parallel Llama: one graph, and the numbers of eager.

TP 2 with sequence parallel on gloo: dynamo traces the sequence-parallel collectives as
functional collectives and selective recompute as torch's checkpoint operator, so the compiled
forward and backward are one graph with no break. Inductor fuses and reorders fp32 reductions
(norms, softmax, matmul accumulation), so compiled and eager agree to a few ulps per op, not
bitwise: losses within 1e-5, every gradient within 1e-5 of its own largest magnitude (measured:
about 1e-6). Attention dropout draws from the tensor-parallel RNG stream, which dynamo cannot
trace: its checkpoint runs eagerly with exact replay, a graph break per layer.
"""

from __future__ import annotations

import torch

import neuron_ckpt as nc
from neuron_ckpt.models import LlamaForCausalLM
from neuron_ckpt.recompute import RecomputeConfig, apply_recompute

from .helpers import TINY, tiny_config

TOL = 1e-5


LEAN = RecomputeConfig(granularity="selective", modules=("core_attn", "mlp_act", "norm"))


def _model(recompute: str | RecomputeConfig | None, attention_dropout: float = 0.0) -> LlamaForCausalLM:
    nc.initialize_model_parallel(2)
    torch.manual_seed(0)
    config = tiny_config(attention_dropout=attention_dropout)
    model = LlamaForCausalLM(config, sequence_parallel=True)
    apply_recompute(model, RecomputeConfig.preset(recompute) if isinstance(recompute, str) else recompute)
    return model


def _step(fn, model: LlamaForCausalLM, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    nc.model_parallel_manual_seed(1)
    model.zero_grad(set_to_none=True)
    loss = fn(ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _compiled_against_eager(recompute: str | RecomputeConfig | None, attention_dropout: float = 0.0) -> dict:
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    # Inductor draws random numbers from the same aten ops as eager, so dropout masks match.
    inductor_config.fallback_random = True
    model = _model(recompute, attention_dropout)
    ids = torch.randint(0, TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    nc.model_parallel_manual_seed(1)
    explained = torch._dynamo.explain(lambda ids: model(ids, labels=ids).loss)(ids)
    eager_loss, eager_grads = _step(model, model, ids)
    compiled_loss, compiled_grads = _step(torch.compile(model), model, ids)
    grad_error = max(
        float((compiled_grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-30)) for n, g in eager_grads.items()
    )
    return {
        "graphs": explained.graph_count,
        "breaks": explained.graph_break_count,
        "loss_error": abs(compiled_loss - eager_loss),
        "grad_error": grad_error,
    }


def test_compiled_tp2_model_is_one_graph_and_matches_eager(world):
    # LEAN: selective's core attention plus output-discarding norms and SwiGLU; compiled they are
    # torch's checkpoint operator. (Selective alone compiles in the tutorial's test below.)
    for recompute in (None, LEAN):
        for rank in world(2).run(_compiled_against_eager, recompute):
            assert (rank["graphs"], rank["breaks"]) == (1, 0), (recompute, rank)
            assert rank["loss_error"] < TOL and rank["grad_error"] < TOL, (recompute, rank)


def test_compiled_recompute_replays_tensor_parallel_dropout(world):
    # A wrong replay (a fresh mask in recompute) gives gradients off by tens of percent.
    for rank in world(2).run(_compiled_against_eager, "selective", 0.1):
        assert rank["loss_error"] < TOL and rank["grad_error"] < TOL, rank


def test_tutorial_compile_trains_like_eager(world, tmp_path):
    import numpy as np

    from .tutorial_run import tiny_run_files, train

    blocks = (np.random.default_rng(0).integers(0, 128, size=(16, 1)) + np.arange(16)) % 128
    argv = tiny_run_files(tmp_path, blocks) + [
        "--tp", "2", "--sequence-parallel", "--recompute", "selective", "--global-batch-size", "4",
        "--max-steps", "3", "--warmup-steps", "1", "--lr", "1e-2",
    ]  # fmt: skip
    eager = world(2).run(train, argv)[0]["losses"]
    compiled = world(2).run(train, argv + ["--compile"])[0]["losses"]
    assert len(compiled) == 3 and np.allclose(compiled, eager, rtol=0, atol=1e-4), (compiled, eager)
