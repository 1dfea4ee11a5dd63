"""Recompute on a ``transformers`` model: saved bytes, step time and exactness, side by side.

One process, fp32, CPU by default; a tiny ``transformers.LlamaForCausalLM`` built from a config,
shaped so that the s^2 attention terms dominate what autograd keeps (seq 512, hidden 256)::

    python scripts/bench_hf_recompute.py                  # 4 layers, seq 512: ~15 s on 2 idle cores
    python scripts/bench_hf_recompute.py --attn sdpa      # the fused kernel instead of eager

Variants, each a fresh model loaded with the same state dict:

* ``none``: no recompute;
* ``hf ckpt``: transformers' own ``model.gradient_checkpointing_enable()`` (its defaults);
* ``selective``: ``apply_recompute(model, RecomputeConfig.preset("selective"))``, only the
  attention function recomputed (through transformers' ``AttentionInterface``);
* ``full``: ``RecomputeConfig.preset("full")``, each decoder layer checkpointed.

Per variant: the storages autograd keeps for backward over one forward
(``neuron_ckpt.memory.SavedTensorRecorder``, parameters left out), in total and divided by the
layer count (the total includes the embedding, final norm, head and loss, so it is per layer
"on average"); the forward + backward step time, median of ``--iters`` steps after ``--warmup``
untimed ones (variants take turns each iteration so drift hits them alike), and its ratio to
``none`` (and the best step, with its ratio: on a shared machine interference only adds
time); the loss and the largest gradient difference against ``none``, which must be 0 (same
seed, same inputs, no dropout).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn", type=int, default=688)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--attn", default="eager", choices=["eager", "sdpa"])
    p.add_argument("--iters", type=int, default=9)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    return p.parse_args()


def build(a: argparse.Namespace, variant: str, state: dict | None):
    import transformers

    from neuron_ckpt.recompute import RecomputeConfig, apply_recompute

    config = transformers.LlamaConfig(
        hidden_size=a.hidden, intermediate_size=a.ffn, num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads, num_hidden_layers=a.layers, vocab_size=a.vocab,
        max_position_embeddings=a.seq, attention_dropout=0.0, use_cache=False,
    )  # fmt: skip
    config._attn_implementation = a.attn
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float().train()
    if state is not None:
        model.load_state_dict(state)
    if variant == "hf ckpt":  # transformers 5 deprecates this name for activation_checkpointing_enable
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable()
    elif variant != "none":
        apply_recompute(model, RecomputeConfig.preset(variant))
    return model


def step(model, ids) -> torch.Tensor:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach()


def main() -> None:
    a = parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    from neuron_ckpt.memory import SavedTensorRecorder

    ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=torch.Generator().manual_seed(1))
    names = ["none", "hf ckpt", "selective", "full"]
    models: dict[str, torch.nn.Module] = {}
    saved: dict[str, int] = {}
    check: dict[str, tuple[float, float]] = {}
    ref_loss = ref_grads = None
    for name in names:
        model = models[name] = build(a, name, models["none"].state_dict() if models else None)
        with SavedTensorRecorder(exclude_modules=[model]) as rec:
            loss = model(input_ids=ids, labels=ids).loss
        saved[name] = rec.total_bytes
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        if ref_grads is None:
            ref_loss, ref_grads = loss.detach(), grads
        diff = max((grads[n] - g).abs().max().item() for n, g in ref_grads.items())
        check[name] = (loss.item(), abs(loss.item() - ref_loss.item()), diff)

    times: dict[str, list[float]] = {k: [] for k in names}
    start = time.perf_counter()
    for it in range(a.warmup + a.iters):
        for name in names:
            models[name].zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            step(models[name], ids)
            if it >= a.warmup:
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}  # interference only adds time: the stable estimate

    import transformers

    print(
        f"LlamaForCausalLM seq={a.seq} hidden={a.hidden} heads={a.heads}/{a.kv_heads}kv ffn={a.ffn} "
        f"layers={a.layers} vocab={a.vocab} batch={a.batch} attn={a.attn} fp32 "
        f"threads={torch.get_num_threads()} torch {torch.__version__} transformers {transformers.__version__} "
        f"iters={a.iters} (+{a.warmup} warmup), timing {time.perf_counter() - start:.0f} s"
    )
    mib = 2**20
    print(f"{'variant':10s} {'saved/layer':>12s} {'saved total':>12s} {'vs none':>8s} "
          f"{'step (med)':>11s} {'vs none':>8s} {'best':>8s} {'vs none':>8s} "
          f"{'loss':>10s} {'|dloss|':>8s} {'max|dgrad|':>10s}")  # fmt: skip
    for k in names:
        loss, dloss, dgrad = check[k]
        print(
            f"{k:10s} {saved[k] / a.layers / mib:8.2f} MiB {saved[k] / mib:8.2f} MiB {saved[k] / saved['none']:8.3f} "
            f"{med[k] * 1e3:8.0f} ms {med[k] / med['none']:8.3f} "
            f"{best[k] * 1e3:5.0f} ms {best[k] / best['none']:8.3f} {loss:10.6f} {dloss:8.1e} {dgrad:10.1e}"
        )
    exact = all(d == 0 and g == 0 for _, d, g in check.values())
    print(f"check: loss and every gradient equal to none: {'yes' if exact else 'NO'}")


if __name__ == "__main__":
    main()
