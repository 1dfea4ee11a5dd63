"""What one decoder layer of a transformers Llama keeps for backward at TP 2, with and without
sequence parallel (issue #35), next to our own Llama's layer at the same shape (analytic, which
equals measured: tests/test_memory_llama.py).

bf16, transformers' sdpa (ours: flash, torch's same SDPA kernel), h 256, f 688, 8 heads, 4 kv
heads, s 512, b 1; bytes autograd keeps for layer 1 of 2 (``SavedTensorRecorder``, parameters
left out), on rank 0 of 2 gloo processes::

    python scripts/hf_sequence_parallel_memory.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import transformers

import neuron_ckpt as nc
from neuron_ckpt.distributed.local import LocalWorld
from neuron_ckpt.memory.analytic import layer_activation_bytes
from neuron_ckpt.memory.measure import SavedTensorRecorder
from neuron_ckpt.memory.shape import ModelShape, TrainingSetup
from neuron_ckpt.recompute import RecomputeConfig, apply_recompute

H, F, A, KV, S, T = 256, 688, 8, 4, 512, 2
PRESETS = ("none", "selective", "selective+mlp_act+norm", "full")
MIB = 1 << 20


def measure(sequence_parallel: bool, preset: str) -> int:
    nc.initialize_model_parallel(T)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=H, intermediate_size=F, num_hidden_layers=2,
                                      num_attention_heads=A, num_key_value_heads=KV, max_position_embeddings=S,
                                      use_cache=False)  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).train()
    nc.apply_tensor_parallel(model, sequence_parallel=sequence_parallel)
    apply_recompute(model, RecomputeConfig.preset(preset))
    ids = torch.randint(0, 128, (1, S))
    with SavedTensorRecorder(exclude_modules=[model]) as rec:
        handles = rec.attach({"layer1": model.model.layers[1]})
        out = model(input_ids=ids, labels=ids)
        for handle in handles:
            handle.remove()
    out.loss.backward()
    return rec.bytes_by_scope().get("layer1", 0)


def main() -> None:
    ours = ModelShape("llama", H, A, KV, F, 2, 128)
    print("| recompute | transformers TP 2 | transformers TP 2 + SP | ours TP 2 + SP (flash) |")
    print("|---|---:|---:|---:|")
    with LocalWorld(T) as world:
        for preset in PRESETS:
            tp, sp = (world.run(measure, s, preset)[0] for s in (False, True))
            mine = layer_activation_bytes(ours, TrainingSetup(S, 1, T, dtype="bf16", attention="flash"), preset)
            print(f"| {preset} | {tp / MIB:.3f} MiB | {sp / MIB:.3f} MiB | {mine / MIB:.3f} MiB |")


if __name__ == "__main__":
    main()
