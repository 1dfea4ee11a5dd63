"""What the ``transformers`` conversions read of a model: its config, its parallel state, its parameters.

``LlamaForCausalLM``, one pipeline stage (``LlamaStage``) and a whole pipeline's local stages
(``LlamaPipeline``, not a ``torch.nn.Module``) all answer it. Typed as this protocol rather than
``torch.nn.Module``, whose attributes torch types as ``Tensor | Module``, so the checker sees what
the conversions use.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from ..distributed.parallel_state import ParallelState
    from .llama_args import LlamaArgs


class ParallelModel(Protocol):
    """Parameters named as our Llama's, each this rank's tensor-parallel shard."""

    @property
    def args(self) -> LlamaArgs: ...

    @property
    def parallel_state(self) -> ParallelState: ...

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]: ...
