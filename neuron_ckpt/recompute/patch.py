"""Instance attributes that recompute sets on a module (a method it calls on itself), and putting
them back: some recompute units are not a submodule to wrap but a method a module calls on
itself (the experts' ``_apply_gate``, MLA's ``forward``). The original is recorded on the
module so that :func:`~.apply.remove_recompute` restores it."""

from __future__ import annotations

from typing import Any

import torch

_PATCHED = "_neuron_ckpt_patched"  # on a patched module: {attribute: what its __dict__ held, or _ABSENT}
_ABSENT = object()


def patch(module: torch.nn.Module, name: str, value: Any) -> None:
    """Set ``module.<name>`` to ``value`` on the instance (the class is untouched)."""
    saved = module.__dict__.setdefault(_PATCHED, {})
    saved.setdefault(name, module.__dict__.get(name, _ABSENT))
    module.__dict__[name] = value


def mark(module: torch.nn.Module, text: str) -> None:
    """Show ``text`` in ``print(model)`` on ``module`` (what recompute changed in it)."""
    patch(module, "extra_repr", _ExtraRepr(module.extra_repr(), text))


class _ExtraRepr:
    def __init__(self, original: str, text: str):
        self.text = f"{text}; {original}" if original else text

    def __call__(self) -> str:
        return self.text


def unpatch(modules: Any) -> None:
    """Restore every attribute :func:`patch` set on ``modules`` (an iterable of modules)."""
    for module in modules:
        for name, old in module.__dict__.pop(_PATCHED, {}).items():
            if old is _ABSENT:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = old
