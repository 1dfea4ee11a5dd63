"""Constructor arguments every parallel layer takes: positive sizes, and an optional parallel state."""

from __future__ import annotations

from ..distributed.parallel_state import ParallelState, get_parallel_state


def check_sizes(**sizes: int) -> None:
    """Raise ``ValueError`` naming the first argument that is not a positive int.

    ``check_sizes(in_features=in_features, out_features=out_features)``.
    """
    for name, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def resolve_parallel_state(parallel_state: ParallelState | None) -> ParallelState:
    """``parallel_state`` if given, else the one :func:`~neuron_ckpt.initialize_model_parallel` set.

    Raises :class:`~neuron_ckpt.distributed.parallel_state.ModelParallelNotInitializedError` when
    neither exists.
    """
    return parallel_state if parallel_state is not None else get_parallel_state()
