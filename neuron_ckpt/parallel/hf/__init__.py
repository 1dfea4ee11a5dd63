"""Tensor parallelism for a ``transformers`` model, from the plan the model carries.

Every transformers causal LM names how its modules split over a tensor-parallel group
(``model.tp_plan``: ``config.base_model_tp_plan`` under the base model's prefix, plus the LM head
and the input embedding). :func:`apply_tensor_parallel` reads that plan and swaps each planned
module for our layer of the same shape, sliced from the weights the model already holds:

===============================  =============================================================
plan style                        becomes
===============================  =============================================================
``colwise``                       :class:`ColumnParallelLinear` (output stays split)
``colwise_gather_output``         :class:`ColumnParallelLinear` with ``gather_output``
``rowwise``                       :class:`RowParallelLinear` (input already split)
``rowwise_split_input``           :class:`RowParallelLinear` splitting its replicated input
``embedding_rowwise``             :class:`VocabParallelEmbedding` (vocabulary rows split)
``replicated_with_grad_allreduce``  kept; each parameter's gradient is summed over the group
``replicate``                     kept as it is
``moe_tp_experts``                experts module: inputs enter, output leaves the TP region
``packed_colwise`` (parameter)    an experts' ``gate_up_proj``: gate and up rows sliced alike
``rowwise`` (3-D parameter)       an experts' ``down_proj``: sliced on its intermediate dim
``mla_kv_a_proj``                 kept; the rotary key's gradient summed over the group
``grouped_gemm`` (parameter)      under EP: an experts' weight or bias sliced on dim 0 (whole experts)
``ep_dispatch_experts``           under EP: the experts' tokens sent to their EP ranks and back
===============================  =============================================================

Mixture-of-experts models (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3, Llama 4, Aria) split each
expert's intermediate size, the router stays whole: see :mod:`.experts`; under expert parallelism
(``expert_model_parallel_size`` > 1) the model's ``ep_plan`` spreads whole experts over the EP
group instead: :mod:`.expert_parallel` (and :mod:`.export` gathers the model back whole);
multi-head latent attention (DeepSeek-V2's plan): :mod:`.mla`.

``loss_parallel`` (default on): the LM head planned ``colwise_gather_output`` keeps its logits
split over the vocabulary and the model's loss becomes :func:`vocab_parallel_cross_entropy`, so
the ``[b, s, v]`` logits are never gathered; ``outputs.logits`` is then this rank's vocabulary
slice. Parameter names stay as they are; a state dict holds this rank's slices, and
``load_state_dict`` accepts either those or the full tensors (sliced on the way in), so a
checkpoint loads before or after the swap. Everything is checked before anything changes: a
style we do not map, a module that is not the kind its style needs, or heads that do not split
evenly is a one-line ``ValueError`` naming the module and the style.

Attention modules whose heads are split and that drop out run inside
``get_rng_tracker().fork()`` (forward hooks), so each rank draws its own dropout mask for its own
heads, as our ``CoreAttention`` does; that needs ``model_parallel_manual_seed`` first.

Not covered: sequence parallelism (transformers' activations are ``[b, s, h]`` and its norms are
its own), and key/value heads fewer than the group (replicating them, as
:class:`QKVParallelLinear` does, would need the attention module's own head counts changed).

Files: ``plan`` reads the plan and runs the styles (``STYLES`` for entries naming a module,
``PARAMETER_STYLES`` for entries naming a parameter: tables of style -> check and apply, joined
from the files that define them; ``PLAN_CHECKS`` across entries); ``dense`` holds the linear,
embedding and replicated styles; ``experts`` the mixture-of-experts ones, ``expert_parallel`` the
expert-parallel ones; ``mla`` latent
attention's; ``shards`` slices and tags parameters; ``loss`` the vocabulary-parallel loss;
``dropout`` split attention's RNG stream.
"""

from .expert_parallel import dropped_routes
from .export import gather_state_dict, save_pretrained
from .plan import PARAMETER_STYLES, STYLES, apply_tensor_parallel

__all__ = [
    "PARAMETER_STYLES",
    "STYLES",
    "apply_tensor_parallel",
    "dropped_routes",
    "gather_state_dict",
    "save_pretrained",
]
