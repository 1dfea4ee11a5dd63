"""What the memory tools describe: a model's shape (:class:`ModelShape`) and how a job runs it
(:class:`TrainingSetup`). The analytic model, the budget, the planner, the reports and the
measured layers all take these two, with a recompute preset beside them
(:data:`neuron_ckpt.recompute.PRESETS`), so every derived rule is written here once: the head
size, the heads one tensor-parallel rank holds, which degrees can shard the model, its
parameters and its FLOPs per token.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ..checks import require_positive_int
from ..parallel.attention import ATTENTION

if TYPE_CHECKING:
    from ..models.llama_args import LlamaArgs

KINDS = ("llama", "gpt")
FLASH_KERNELS = ("torch", "nki")
"""Which flash kernel runs: torch's SDPA (CPU, CUDA) or NxD's NKI kernel (trn1)."""
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
DEFAULT_VOCAB = 51200  # the paper's GPT vocabulary
_FP32 = 4


def default_ffn(kind: str, hidden: int) -> int:
    """The MLP width when none is given: 4h for GPT (the paper's layer), Llama's SwiGLU rule
    otherwise: 2/3 of 4h rounded up to a multiple of 256 (11008 for h = 4096)."""
    return 4 * hidden if kind == "gpt" else 256 * -(-(8 * hidden) // (3 * 256))


@dataclass(frozen=True)
class ModelShape:
    """The sizes of one decoder stack, its embedding and its LM head.

    kind: "llama" (:mod:`neuron_ckpt.models.llama`: RMSNorm, GQA, SwiGLU) or "gpt"
        (the paper's layer, :mod:`neuron_ckpt.models.gpt`: MLP width 4h, biases, tied head).
    hidden, heads, kv_heads, ffn, layers, vocab: h, a, g (= a without GQA; must divide a), f,
        L, v. A GPT has kv_heads = heads and ffn = 4h.
    name: how reports call it ("llama2-7b"); empty: the kind.
    head_dim: d; None means h / a, which must then divide exactly.
    attention_bias, mlp_bias: Llama's optional biases (they change the parameter count only).
    tie_word_embeddings: Llama's LM head is the embedding table (one parameter, counted once);
        a GPT always ties them.
    """

    kind: str
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    layers: int
    vocab: int
    name: str = ""
    head_dim: int = None  # type: ignore[assignment]  # None: h / a, set in __post_init__
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("hidden", "heads", "kv_heads", "ffn", "layers", "vocab"):
            require_positive_int(name, getattr(self, name))
        if self.head_dim is None:
            if self.hidden % self.heads:
                raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        require_positive_int("head_dim", self.head_dim)
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads ({self.kv_heads}) must divide heads ({self.heads})")
        for name in ("attention_bias", "mlp_bias", "tie_word_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.kind == "gpt":
            if self.kv_heads != self.heads:
                raise ValueError(f"kv_heads applies to llama only; gpt has kv_heads = heads, got {self.kv_heads!r}")
            if self.ffn != 4 * self.hidden:
                raise ValueError(
                    f"ffn for gpt must be 4 * hidden = {4 * self.hidden} (the paper's layer), got {self.ffn!r}"
                )
            if self.head_dim * self.heads != self.hidden:
                raise ValueError(
                    f"head_dim for gpt must be hidden / heads = {self.hidden // self.heads}, got {self.head_dim!r}"
                )

    @classmethod
    def gpt(cls, hidden: int, heads: int, layers: int, vocab: int = DEFAULT_VOCAB, name: str = "") -> ModelShape:
        """The paper's GPT: MLP width 4h, no GQA, vocab 51200 by default."""
        return cls("gpt", hidden, heads, heads, default_ffn("gpt", hidden), layers, vocab, name)

    @classmethod
    def from_llama(cls, args: LlamaArgs | Any, name: str = "") -> ModelShape:
        """From a :class:`~neuron_ckpt.models.llama_args.LlamaArgs`, or a ``transformers``
        config through ``LlamaArgs.from_hf`` (which refuses what the model does not build)."""
        from ..models.llama_args import LlamaArgs  # lazily: the models package imports torch

        args = LlamaArgs.from_hf(args)
        return cls(
            "llama", args.hidden_size, args.num_attention_heads, args.num_key_value_heads,
            args.intermediate_size, args.num_hidden_layers, args.vocab_size, name, args.head_dim,
            args.attention_bias, args.mlp_bias, args.tie_word_embeddings,
        )  # fmt: skip

    # --- tensor parallelism -------------------------------------------------------------
    def local_heads(self, tp: int) -> int:
        """Query heads on one rank."""
        return self.heads // tp

    def local_kv_heads(self, tp: int) -> int:
        """Key/value heads on one rank: g/t, or 1 replicated head when g < t (QKVParallelLinear)."""
        return max(self.kv_heads // tp, 1)

    def valid_tp(self, tp: int, seq_len: int | None = None, include_vocab: bool = True) -> str | None:
        """Why ``tp`` cannot shard this model (None when it can). ``seq_len``: the sequence that
        sequence parallel splits; ``include_vocab``: False for the layers alone (no embedding)."""
        checks = [
            (self.heads % tp == 0, f"tp ({tp}) must divide heads ({self.heads})"),
            (self.kv_heads % tp == 0 or tp % self.kv_heads == 0,
             f"kv_heads ({self.kv_heads}) must be a multiple of tp ({tp}) or divide it"),
            (self.ffn % tp == 0, f"tp ({tp}) must divide the MLP width ffn ({self.ffn})"),
            (not include_vocab or self.vocab % tp == 0, f"tp ({tp}) must divide vocab ({self.vocab})"),
            (seq_len is None or seq_len % tp == 0,
             f"seq_len ({seq_len}) must be a multiple of tp ({tp}) when sequence_parallel is True"),
        ]  # fmt: skip
        return next((why for ok, why in checks if not ok), None)

    # --- parameters and FLOPs -----------------------------------------------------------
    def local_parameters(self, tp: int = 1) -> int:
        """Parameters one tensor-parallel rank holds: its 1/t shard of every split weight plus the
        replicated ones (norms, row-parallel biases; kv heads replicated when g < t)."""
        h, d, v, f, L = self.hidden, self.head_dim, self.vocab, self.ffn, self.layers
        a_loc, g_loc = self.local_heads(tp), self.local_kv_heads(tp)
        if self.kind == "llama":
            per_layer = h * (2 * a_loc + 2 * g_loc) * d + 3 * h * f // tp + 2 * h  # + two RMSNorms
            if self.attention_bias:  # q, k, v split by heads; o_proj's replicated
                per_layer += (a_loc + 2 * g_loc) * d + h
            if self.mlp_bias:  # gate and up split; down's replicated
                per_layer += 2 * f // tp + h
            tables = 1 if self.tie_word_embeddings else 2  # embedding and LM head, or one for both
            return L * per_layer + tables * (v // tp) * h + h  # + final norm
        # GPT: QKV, projection, fc1, fc2 with biases (row biases replicated), two LayerNorms; tied head.
        per_layer = 4 * h * h // tp + 2 * h * f // tp + (3 * h + f) // tp + 2 * h + 4 * h
        return L * per_layer + v // tp * h + 2 * h

    def num_parameters(self, include_embedding: bool = True) -> int:
        """Parameters of the whole model. A tied model (GPT, or Llama with ``tie_word_embeddings``)
        has one table, which is the LM head and always counts."""
        n = self.local_parameters(1)
        tied = self.kind == "gpt" or self.tie_word_embeddings
        return n if include_embedding or tied else n - self.vocab * self.hidden

    def flops_per_token(self, seq_len: int) -> float:
        """Training (forward + backward) FLOPs per token, for model-FLOPs utilisation (MFU)::

            6 * N  +  12 * L * H * Q * T

        (PaLM, Chowdhery et al. 2022, appendix B). ``N``: the parameters that take part in a
        matmul, 2 FLOPs per token forward and 4 backward each; for Llama every parameter but the
        input embedding table (a lookup; the untied LM head counts), for GPT the 12h^2 weights of
        each layer and the tied head. ``12 L H Q T``: the scores ``QK^T`` and ``softmax @ V``
        (``L`` layers, ``H`` query heads of size ``Q``, sequence ``T``), 2 matmuls x 2 FLOPs x 3;
        like PaLM and Megatron it counts the whole ``T x T`` square, not the causal half.
        Recomputation is not counted (MFU counts useful model FLOPs); norms, RoPE, softmax and
        the activation functions are left out.
        """
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if self.kind == "llama":
            n = self.num_parameters(include_embedding=False)
        else:
            n = self.layers * 12 * self.hidden**2 + self.vocab * self.hidden
        return 6.0 * n + 12.0 * self.layers * self.heads * self.head_dim * seq_len


@dataclass(frozen=True)
class TrainingSetup:
    """How the job runs, per device.

    seq_len, micro_batch: s and b of one micro-batch (s: the whole sequence). tp, dp: tensor- and
        data-parallel degrees. cp: the context-parallel degree (``context_parallel_size``): each rank
        runs ``s / cp`` of the sequence's tokens (:mod:`neuron_ckpt.parallel.context_parallel`);
        ZeRO-1 shards over dp x cp.
    dtype: parameters, gradients and activations ("bf16" | "fp16" | "fp32").
    sequence_parallel: Megatron sequence parallelism (the tutorial's default).
    zero1: shard master weights and AdamW moments over dp (``Zero1Optimizer``).
    master_weights: keep fp32 master weights; None means yes unless the model is fp32 without
        ZeRO-1 (``Zero1Optimizer`` always keeps an fp32 slice, even of fp32 parameters).
    microbatches_in_flight: activations of how many micro-batches are alive at once: 1 without
        pipeline parallelism (gradient accumulation runs them one after another).
    bucket_cap_mb: ZeRO-1's bucket cap (``Zero1Optimizer(bucket_cap_mb=...)``): the largest
        collective of the optimizer step; None: one bucket for everything (no cap).
    accumulate_fp32: ZeRO-1 accumulates 16-bit gradients in fp32 buffers (4 bytes per
        parameter) and reduces them in fp32; None: on for bf16/fp16 with ZeRO-1, as the optimizer.
    attention: the core attention (:data:`~neuron_ckpt.parallel.attention.ATTENTION`):
        "explicit" keeps the ``[b, a/t, s, s]`` probabilities (the paper's layer), "flash" a fused
        kernel that keeps none (:mod:`neuron_ckpt.parallel.flash`).
    cp: see above. flash_kernel: with ``attention="flash"``, the kernel (:data:`FLASH_KERNELS`):
        ``"torch"`` keeps k and v at the kv heads; ``"nki"`` (trn1) is called with k and v repeated
        to the query heads (NxD's wrapper launches over query heads) and keeps them so. It takes
        equal query and key lengths only, so under context parallelism trn1 runs the explicit
        attention (:meth:`at_context_parallel`).
    """

    seq_len: int
    micro_batch: int = 1
    tp: int = 1
    dp: int = 1
    dtype: str = "bf16"
    sequence_parallel: bool = True
    zero1: bool = True
    master_weights: bool | None = None
    microbatches_in_flight: int = 1
    bucket_cap_mb: float | None = 128.0
    accumulate_fp32: bool | None = None
    attention: str = "explicit"
    cp: int = 1
    flash_kernel: str = "torch"

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {self.attention!r}")
        for name in ("seq_len", "micro_batch", "tp", "dp", "microbatches_in_flight", "cp"):
            require_positive_int(name, getattr(self, name))
        if self.flash_kernel not in FLASH_KERNELS:
            raise ValueError(f"flash_kernel must be one of {FLASH_KERNELS}, got {self.flash_kernel!r}")
        if self.cp > 1 and self.attention == "flash" and self.flash_kernel == "nki":
            raise ValueError(
                f"attention 'flash' with flash_kernel 'nki' at cp {self.cp}: NxD's NKI kernel takes equal query and "
                "key lengths only, so trn1 runs the explicit attention under context parallelism; use "
                "attention='explicit' (TrainingSetup.at_context_parallel does)"
            )
        if self.cp > 1:
            from ..parallel.context_parallel.split import check_sequence  # lazily: it imports torch

            check_sequence(self.seq_len, self.cp, self.tp, self.sequence_parallel)
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {tuple(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.bucket_cap_mb is not None and not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be None or > 0, got {self.bucket_cap_mb!r}")
        if self.zero1 and self.master_weights is False:
            raise ValueError("master_weights=False with zero1=True: Zero1Optimizer always keeps an fp32 master slice")

    @property
    def width(self) -> int:
        """Bytes per parameter, gradient and activation element."""
        return DTYPE_BYTES[self.dtype]

    @property
    def keeps_master_weights(self) -> bool:
        if self.master_weights is not None:
            return self.master_weights
        return self.zero1 or self.dtype != "fp32"

    def at_context_parallel(self, cp: int) -> TrainingSetup:
        """This job at context-parallel degree ``cp``, with the attention that then runs: on trn1
        (``flash_kernel="nki"``) flash runs explicit under CP (``parallel/flash.py``)."""
        if cp > 1 and self.attention == "flash" and self.flash_kernel == "nki":
            return replace(self, cp=cp, attention="explicit", flash_kernel="torch")
        return replace(self, cp=cp)

    @property
    def local_seq_len(self) -> int:
        """Tokens of one sequence on one rank's layers: ``s / cp``."""
        return self.seq_len // self.cp

    @property
    def optimizer_shards(self) -> int:
        """Ranks ZeRO-1 shards the optimizer state over: dp x cp (the weights are replicated over both)."""
        return self.dp * self.cp if self.zero1 else 1

    @property
    def grad_width(self) -> int:
        """Bytes per gradient element: fp32 buffers when ZeRO-1 accumulates 16-bit gradients."""
        on = self.accumulate_fp32 if self.accumulate_fp32 is not None else self.width < _FP32
        return _FP32 if self.zero1 and on else self.width


__all__ = ["DEFAULT_VOCAB", "DTYPE_BYTES", "FLASH_KERNELS", "KINDS", "ModelShape", "TrainingSetup", "default_ffn"]
