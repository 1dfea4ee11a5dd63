"""Tear down torch.distributed and every process group this package holds, in a safe order.

The one step that needs both :mod:`.parallel_state` and :mod:`.runtime` lives here, so the
dependency between those two runs one way (``parallel_state`` imports ``runtime``, never back).
"""

from __future__ import annotations

from . import parallel_state, runtime


def destroy_distributed() -> None:
    """Tear down torch.distributed and every process group this package holds.

    Releases, in this order: the parallel state (:func:`~.parallel_state.destroy_model_parallel`),
    the process group of every :class:`~.parallel_state.Group` still alive (held by layers, a
    ``ParallelState`` the caller kept, autograd nodes), the runtime with its ``host_group`` (the
    gloo group when the default group is not gloo; a :class:`~.runtime.Runtime` the caller kept
    reads None afterwards), and
    then the process groups themselves (``destroy_process_group()``, WORLD included). The process
    groups are freed inside this call: with torch 2.13's gloo, one that outlives
    ``destroy_process_group()`` aborts the interpreter at exit about one run in five
    ("terminate called without an active exception"). A script ending with this call exits
    cleanly; so do tests and scripts that run several worlds in one process.
    """
    parallel_state.destroy_model_parallel()
    parallel_state.release_process_groups()
    runtime.destroy_runtime()
