"""Value checks the typed configs share (:class:`~neuron_ckpt.models.llama_args.LlamaArgs`,
:class:`~neuron_ckpt.memory.shape.ModelShape`). Imports nothing, so the memory tools use it
without importing the models package (torch, transformers)."""

from __future__ import annotations

from typing import TypeGuard


def is_int(value: object) -> TypeGuard[int]:
    """An ``int`` that is not a ``bool`` (``True`` is an ``int`` to Python, not a count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int_problem(name: str, value: object) -> str | None:
    """Why ``value`` is not a positive integer (None when it is)."""
    if is_int(value) and value >= 1:
        return None
    return f"{name} must be a positive integer, got {value!r} ({type(value).__name__})"


def require_positive_int(name: str, value: object) -> None:
    """A ``ValueError`` naming ``name`` unless ``value`` is a positive integer."""
    problem = positive_int_problem(name, value)
    if problem:
        raise ValueError(problem)
