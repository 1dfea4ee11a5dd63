"""What many test files share: the two relative errors, the tiny Llama, the two command lines
(``neuron-ckpt`` in-process, ``prepare_data.py`` in a subprocess), attribute patching inside
worker processes and counting forward calls (a free port: ``neuron_ckpt.distributed.runtime.free_port``).

Imported by the torch-xla suite too (``tests_xla``), so nothing here imports more than torch at
module level.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
PREPARE_DATA = REPO / "tutorials" / "llama2_7b_tp_zero1" / "prepare_data.py"


def rel_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error ``||a - b|| / ||b||`` (Frobenius norms), in fp64 on the CPU (any devices):
    for layers and ops, where every element counts alike."""
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error ``max |a - b| / max |b|``, in fp64 on the CPU: for whole models against a
    reference, where one wrong element must not hide in the norm of many right ones."""
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


TINY = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
}  # fmt: skip
"""The tiny Llama of the suite: the tutorial runs' config file, and :func:`tiny_config`."""


def tiny_config(**fields: Any):
    """``transformers.LlamaConfig`` of :data:`TINY`, with ``fields`` changed, eager attention."""
    import transformers

    return transformers.LlamaConfig(**TINY | fields, attn_implementation="eager")


def neuron_ckpt_cli(capsys: Any, *argv: str) -> tuple[int, str, str]:
    """``neuron-ckpt argv`` in this process: (exit status, stdout, stderr), read off ``capsys``."""
    from neuron_ckpt.cli import main

    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def run_prepare_data(*args: str | Path) -> subprocess.CompletedProcess:
    """The tutorial's ``prepare_data.py`` with ``args`` (no progress bar), in a subprocess."""
    cmd = [sys.executable, str(PREPARE_DATA), "--no-progress", *map(str, args)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


_ABSENT = object()


@contextlib.contextmanager
def patched(obj: Any, name: str, value: Any) -> Iterator[Any]:
    """``obj.name = value`` inside the block, as it was after it, error or not (an attribute that
    ``obj`` inherited is deleted again); yields the old value. For worker processes (LocalWorld),
    where pytest's ``monkeypatch`` does not reach."""
    own = getattr(obj, "__dict__", {}).get(name, _ABSENT)
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield old
    finally:
        if own is _ABSENT and hasattr(obj, "__dict__"):
            delattr(obj, name)
        else:
            setattr(obj, name, old if own is _ABSENT else own)


@contextlib.contextmanager
def counted_forwards(classes: Iterable[type]) -> Iterator[Callable[[Any], int]]:
    """Count every run of ``forward`` (recomputes included) of every module of ``classes`` (the
    classes are patched); yields ``calls(module)``, that module's count so far."""
    counts: dict[int, int] = {}

    def counting(original):
        def forward(self, *args, **kwargs):
            counts[id(self)] = counts.get(id(self), 0) + 1
            return original(self, *args, **kwargs)

        return forward

    with contextlib.ExitStack() as stack:
        for cls in set(classes):
            stack.enter_context(patched(cls, "forward", counting(cls.forward)))
        yield lambda module: counts.get(id(module), 0)
