"""The last stage's loss over micro-batches, so that the step's loss is the batch's.

``LlamaForCausalLM`` returns the mean cross entropy over the batch's non-ignored next-token
targets. A pipeline computes one micro-batch at a time, and torch's schedule sums what the loss
function returns into the gradients (``scale_grads=False``, :mod:`.schedule`). So each micro-batch
returns its *sum* of token losses divided by the token count of the whole batch (counted before
the step, from the labels the last stage holds): the sum over micro-batches is then exactly the
batch mean, and so is its gradient, however the targets are spread over the micro-batches
(``loss_average="tokens"``, torchtitan's normalisation by global valid tokens). With
``loss_average="micro_batches"`` each micro-batch returns its own mean divided by ``m``, the
mean of means that the training loop's gradient accumulation takes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..distributed.parallel_state import Group
from ..models.llama import IGNORE_INDEX
from ..parallel import vocab_parallel_cross_entropy


def next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` labels -> ``[s, b]`` targets: position ``i`` predicts ``labels[:, i + 1]``."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:].t()


class PipelineLoss:
    """``loss(logits [s, b, v/t], labels [b, s])`` of one micro-batch; :meth:`start` before a step."""

    def __init__(self, group: Group, average: str, micro_batches: int):
        self.group, self.average, self.micro_batches = group, average, micro_batches
        self.tokens: torch.Tensor | None = None

    def start(self, labels: torch.Tensor) -> None:
        """Count the batch's targets (``labels``: the whole ``[m * b, s]`` batch of the step)."""
        self.tokens = (labels[:, 1:] != IGNORE_INDEX).sum()

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.tokens is None:
            raise RuntimeError("PipelineLoss.start(labels) must run before the step")
        target = next_token_targets(labels)
        if self.average == "tokens":
            total = vocab_parallel_cross_entropy(logits, target, IGNORE_INDEX, "sum", group=self.group)
            return total / self.tokens
        mean = vocab_parallel_cross_entropy(logits, target, IGNORE_INDEX, "mean", group=self.group)
        return mean / self.micro_batches
