"""Pipeline parallelism for our Llama on ``torch.distributed.pipelining``, with recompute per stage.

::

    import neuron_ckpt as nc
    from neuron_ckpt.pipeline import LlamaPipeline, PipelineConfig, apply_pipeline_recompute

    nc.initialize_model_parallel(tensor_parallel_size=2, pipeline_parallel_size=2)
    pipe = LlamaPipeline(config, PipelineConfig(schedule="1F1B", micro_batches=4),
                         micro_batch_size=1, seq_len=2048, sequence_parallel=True)
    apply_pipeline_recompute(pipe, RecomputeConfig(granularity="full", method="block", num_layers=1))
    loss = pipe.step(input_ids, labels)      # on the last stage; None elsewhere

Rooms: :mod:`.cut` (which layers each stage holds, where each stage runs), :mod:`.llama_stage`
(one stage's modules), :mod:`.rng` (each stage's dropout streams), :mod:`.loss` (the batch's
loss from micro-batches), :mod:`.schedule` (torch's stages and schedules), :mod:`.tied` (tied
embeddings across the first and last stage), :mod:`.hf_weights` (a stage's slice of a full
state dict), :mod:`.recompute` (recompute per stage), :mod:`.llama_pipeline` (it all, one step).
"""

from .config import SCHEDULES, PipelineConfig
from .cut import PipelineCut, cut_layers
from .llama_pipeline import LlamaPipeline
from .llama_stage import LlamaStage
from .recompute import apply_pipeline_recompute, apply_stage_recompute
from .rng import StageRNG, stage_seed
from .tied import all_reduce_tied_gradients, check_tied_weights

__all__ = [
    "SCHEDULES",
    "LlamaPipeline",
    "LlamaStage",
    "PipelineConfig",
    "PipelineCut",
    "StageRNG",
    "all_reduce_tied_gradients",
    "apply_pipeline_recompute",
    "apply_stage_recompute",
    "check_tied_weights",
    "cut_layers",
    "stage_seed",
]
