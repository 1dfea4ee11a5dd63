"""The resumable data-parallel batch order.

Batch order. What a rank gets at step ``s`` is a pure function of (seed, batch sizes, number of
blocks, s), so resuming at a step replays exactly what an uninterrupted run would have seen;
the only state a checkpoint needs is the step (see `DataParallelBatches.state_dict`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import torch

from .packed import PackedDataset


class DataParallelBatches:
    """The micro-batches this DP rank trains on, step by step; deterministic and resumable.

    Global-batch arithmetic: one optimizer step consumes
    ``global_batch = micro_batch_size * grad_accum * dp_size`` blocks, i.e.
    ``global_batch * block_len`` tokens. An epoch is ``len(dataset) // global_batch`` steps
    (the last partial global batch is dropped so every rank does the same number of steps);
    each epoch is a fresh permutation drawn from ``(seed, epoch)``.

    ``shuffle=False``: the blocks in file order, every epoch, as NxD's
    ``DistributedSampler(shuffle=False, drop_last=True)`` deals them: step ``s`` takes blocks
    ``[s * global_batch, (s + 1) * global_batch)``, and rank ``r`` gets every ``dp_size``-th of
    them from ``r`` on (in the first epoch, exactly the sampler's ranks' lists cut into
    micro-batches).

    Within a step the global batch is split rank-contiguously: rank ``r`` gets blocks
    ``[r * micro_batch_size * grad_accum, (r + 1) * ...)`` of it, cut into ``grad_accum``
    micro-batches. The set of blocks in a step depends only on the global batch size, so
    changing dp_size and grad_accum with the same product keeps the data identical.

    Iterating yields, per step, a list of ``grad_accum`` LongTensors ``[micro_batch_size,
    block_len]`` of input ids (labels are the same ids: the model shifts them). ``start_step=k``
    yields exactly what a fresh iterator yields after k steps. The permutation comes from
    ``torch.randperm`` on a CPU generator: resume with the same torch version.
    """

    def __init__(
        self,
        dataset: PackedDataset,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        start_step: int = 0,
        grad_accum: int = 1,
        shuffle: bool = True,
    ) -> None:
        sizes = {"micro_batch_size": micro_batch_size, "dp_size": dp_size, "grad_accum": grad_accum}
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        self.dataset = dataset
        self.micro_batch_size, self.grad_accum = micro_batch_size, grad_accum
        self.dp_rank, self.dp_size, self.seed, self.shuffle = dp_rank, dp_size, seed, shuffle
        self.global_batch = micro_batch_size * grad_accum * dp_size
        self.steps_per_epoch = len(dataset) // self.global_batch
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"dataset has {len(dataset)} blocks, fewer than one global batch of "
                f"{self.global_batch} (micro_batch_size {micro_batch_size} * grad_accum "
                f"{grad_accum} * dp_size {dp_size})"
            )
        self.step = start_step
        self._epoch_cache: tuple[int, torch.Tensor] | None = None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            # sha256 rather than hash(): the same (seed, epoch) must give the same order in
            # every process and Python version.
            digest = hashlib.sha256(f"{self.seed}/{epoch}".encode()).digest()
            g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
            self._epoch_cache = (epoch, torch.randperm(len(self.dataset), generator=g))
        return self._epoch_cache[1]

    def indices(self, step: int) -> list[list[int]]:
        """Block indices of this rank's micro-batches at ``step``: [grad_accum][micro_batch]."""
        epoch, pos = divmod(step, self.steps_per_epoch)
        per_rank = self.micro_batch_size * self.grad_accum
        if not self.shuffle:  # DistributedSampler's interleave: rank r gets r, r + dp, r + 2 dp, ...
            first = pos * self.global_batch + self.dp_rank
            mine = torch.arange(first, first + per_rank * self.dp_size, self.dp_size)
            return mine.view(self.grad_accum, -1).tolist()
        start = pos * self.global_batch + self.dp_rank * per_rank
        mine = self._permutation(epoch)[start : start + per_rank].view(self.grad_accum, -1)
        return mine.tolist()

    def batches(self, step: int) -> list[torch.Tensor]:
        """This rank's ``grad_accum`` micro-batches at ``step`` (a pure function of step)."""
        return [self.dataset.get_blocks(ix) for ix in self.indices(step)]

    def __iter__(self) -> Iterator[list[torch.Tensor]]:
        return self

    def __next__(self) -> list[torch.Tensor]:
        out = self.batches(self.step)
        self.step += 1
        return out

    def state_dict(self) -> dict[str, int]:
        """The next step plus what must not change across a resume (checked on load)."""
        return {
            "step": self.step,
            "seed": self.seed,
            "global_batch": self.global_batch,
            "num_blocks": len(self.dataset),
            "shuffle": int(self.shuffle),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key in ("seed", "global_batch", "num_blocks", "shuffle"):
            if state.get(key, 1) != self.state_dict()[key]:  # checkpoints before "shuffle": shuffled
                raise ValueError(
                    f"cannot resume data order: {key} is {self.state_dict()[key]} now, "
                    f"checkpoint has {state.get(key, 1)}"
                )
        self.step = int(state["step"])
