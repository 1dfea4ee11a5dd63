"""A copy backend for offload tests on CPU that makes every missing ordering edge show.

Copies run only when something waits for them (an accelerator may run a queued copy at any time
before that, so a program correct here is correct for any timing): a reload runs when the compute
side waits for it, and it first runs the copies it was told to wait for (and nothing else). What
has not been written reads as 0xFF bytes (NaN in every float dtype). The copy to host reads its
source through a weak reference: the engine must keep the source until that copy has run (it
asks ``done(event)``, never true before a wait, or waits for it); a source it let go is read as
freed memory, 0xFF.

So: a reload that does not wait for its own copy to host reads 0xFF (edge b); a consumer that does
not wait for the reload reads 0xFF (edge c); a source released before its copy ran is read as 0xFF
(edge d). :class:`MissingEdge` drops one edge on purpose, to show the tests catch each.
``waits`` counts the waits, ``freed_reads`` the copies that found their source gone.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

POISON = 0xFF


class Event:
    def __init__(self, copy: Callable[[], None], after: list[Event]):
        self.copy, self.after, self.done = copy, after, False

    def complete(self) -> None:
        if not self.done:
            for event in self.after:  # the streams' wait edges
                event.complete()
            self.copy()
            self.done = True


class DeferredCopies:
    def __init__(self) -> None:
        self.freed_reads = 0  # copies to host that found their source let go
        self.waits = 0

    def offload(self, source: torch.Tensor):
        host = torch.full((source.numel(),), POISON, dtype=torch.uint8)
        ref = weakref.ref(source)

        def copy() -> None:
            src = ref()
            if src is None:
                self.freed_reads += 1  # the host buffer stays poisoned
            else:
                host.copy_(src)

        return host, Event(copy, [])

    def done(self, event) -> bool:
        return event is None or event.done

    def reload(self, host: torch.Tensor, device: torch.device, after):
        dest = torch.full((host.numel(),), POISON, dtype=torch.uint8, device=device)
        return dest, Event(lambda: dest.copy_(host), [after] if after is not None else [])

    def wait(self, event) -> None:
        self.waits += 1
        if event is not None:
            event.complete()


class MissingEdge(DeferredCopies):
    """:class:`DeferredCopies` with one edge dropped: ``"b"`` (a reload does not wait for its copy to
        host), ``"c"`` (the consumer does not wait for the reload), ``"d"`` (every copy says it is done:
    the source is let go at once)."""

    def __init__(self, edge: str):
        super().__init__()
        self.edge = edge

    def reload(self, host, device, after):
        return super().reload(host, device, None if self.edge == "b" else after)

    def wait(self, event) -> None:
        if self.edge != "c":
            super().wait(event)

    def done(self, event) -> bool:
        return self.edge == "d" or super().done(event)
