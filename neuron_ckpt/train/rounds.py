"""Checkpoint I/O in writer rounds, and a failure on one rank raised on every rank.

Rounds: a trn1.32xlarge host runs 32 ranks. All of them copying their state to host memory and
writing (or, when resuming, reading) at once would hold 32 ranks' data in host memory and
contend for the filesystem together, so at most ``writers`` ranks per host work at a time: in
rounds by local rank (round ``local_rank // writers``), separated by host barriers
(:func:`~neuron_ckpt.distributed.host.barrier`: no device graph). The default, 8, is NxD's
(``neuronx_distributed`` ``save_checkpoint(num_workers=8)``): 4 rounds on that host.
``writers=0``: every rank at once.

Agreement: a rank whose work fails still takes part in every round's barrier; then all ranks
agree on the outcome (:func:`~neuron_ckpt.distributed.host.agree`): the failing rank raises its
own error and every other rank a RuntimeError, so no rank is left waiting in a collective that
will never come.
"""

from __future__ import annotations

from collections.abc import Callable

from ..distributed import host, runtime

DEFAULT_WRITERS = 8


class WriterRounds:
    """The rounds of this rank's host: ``writers`` local ranks at a time (0: all).
    ``local_rank`` defaults to the runtime's (0 without one)."""

    def __init__(self, local_rank: int | None = None, writers: int = DEFAULT_WRITERS):
        if writers < 0:
            raise ValueError(f"writers must be >= 0 (0: all ranks of a host at once), got {writers}")
        if local_rank is None:
            try:
                local_rank = runtime.get_runtime().local_rank
            except RuntimeError:
                local_rank = 0
        self.local_rank, self.writers = local_rank, writers
        self._count: int | None = None

    def rounds(self) -> tuple[int, int]:
        """``(number of rounds, this rank's round)``. The first call is a collective."""
        if self.writers == 0:
            return 1, 0
        if self._count is None:
            local_ranks = host.all_max(self.local_rank) + 1  # ranks on the fullest host
            self._count = -(-local_ranks // self.writers)
        return self._count, self.local_rank // self.writers

    def run(self, work: Callable[[], None], what: str) -> None:
        """A collective: ``work()`` in this rank's round; a failure anywhere raised everywhere."""
        rounds, mine = self.rounds()
        error = None
        for r in range(rounds):
            if r == mine:
                try:
                    work()
                except BaseException as e:  # noqa: BLE001  re-raised by host.agree, after every round
                    error = e
            if r < rounds - 1:
                host.barrier()
        host.agree(error, what)
