"""Write a tensor-parallel model as a ``transformers`` checkpoint directory, one layer at a time.

``save_hf_checkpoint(model, directory, config)`` writes what
``transformers.LlamaForCausalLM.from_pretrained(directory)`` loads: ``config.json``, the weights
as safetensors shards of at most ``max_shard_size`` (``model-0000X-of-0000N.safetensors`` with
``model.safetensors.index.json``; one shard is ``model.safetensors``, as ``save_pretrained``
names it).

Memory: the shards are planned up front from the parameters' full shapes. The model is gathered
over TP one group at a time (the embedding, each decoder layer, the final norm, the LM head); the
full tensors exist only on global rank 0 (TP rank 0 of DP replica 0), which collects them on the
host until a shard is complete and writes it with safetensors' ``save_file``: its host peak is
about one shard (``max_shard_size``, 2 GB by default) plus one layer.

Who takes part (it is a collective, every rank calls it):

* eager backends (gloo, nccl): the TP group of rank 0 gathers; the other DP replicas hold the
  same weights and only wait for the result (rank 0's error or none, shared with every rank, ends
  the call: :func:`neuron_ckpt.distributed.host.first_problem`);
* XLA: every rank runs the gathers, because an XLA collective is one op of the graph every
  rank executes (``replica_groups`` names all TP groups). A layer's gathers are one graph (one
  ``mark_step``; the same graph for every layer, so it compiles once), then rank 0 copies the
  already computed tensors to the host: no graph per parameter;
* a pipeline (``LlamaPipeline``, ``pipeline_parallel_size > 1``): each group is gathered by the
  stage that holds it and sent to rank 0 (:mod:`.hf_export_groups`); rank 0 writes the whole model.

Atomic: everything is written into a temporary directory next to ``directory`` (each file
fsynced), which is then renamed into place (an existing export is replaced). The output location
is checked (:func:`check_writable`: creatable, writable, enough free space) before anything is
gathered, and a write error on rank 0 is raised on every rank, after the gathers all ranks have
to run anyway, so no rank is left waiting in a collective.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..distributed import runtime
from ..distributed.host import first_problem, rank
from ..files import fsync_dir, write_atomic
from ..paths import dir_problem
from . import hf_conversion
from .hf_checkpoint import CONFIG_NAME, SAFE_INDEX_NAME, SAFE_WEIGHTS_NAME, check_hf_config
from .hf_export_groups import export_groups, to_rank0
from .llama_args import LlamaArgs
from .parallel_model import ParallelModel

# Rank 0 holds one shard on the host before writing it: 2 GB keeps that small beside 32 ranks'
# memory (transformers' save_pretrained default is larger); from_pretrained reads any size.
DEFAULT_MAX_SHARD_SIZE = "2GB"

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like transformers': ``"5GB"`` (10^9), ``"500MiB"`` (2^20)."""
    if isinstance(size, int):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size).upper())
        if not m:
            raise ValueError(f"size {size!r}: expected bytes or a number with KB/MB/GB (or KiB/MiB/GiB)")
        value = int(float(m.group(1)) * _UNITS[m.group(2) or ""])
    if value < 1:
        raise ValueError(f"size must be positive, got {size!r}")
    return value


# --- the output location ------------------------------------------------------------------------


def _writable_problem(directory: Path, required_bytes: int) -> str | None:
    """Why ``directory`` cannot be written (replaced) with ``required_bytes``; None when it can."""
    if directory.exists() and not directory.is_dir():
        return f"{directory} exists and is not a directory"
    parent = directory.parent
    problem = dir_problem(parent)  # creatable and writable: a real probe file
    if problem is not None:
        return problem
    if directory.is_dir() and not os.access(directory, os.W_OK | os.X_OK):
        return f"{directory} exists and cannot be replaced (no write permission on it)"
    free = shutil.disk_usage(parent).free
    if free < required_bytes:
        return f"{parent} has {free / 1e9:.2f} GB free, the checkpoint needs {required_bytes / 1e9:.2f} GB"
    return None


def check_writable(directory: str | Path, required_bytes: int = 0) -> Path:
    """Check that ``directory`` can be written (created, or replaced) and holds ``required_bytes``.

    Collective when torch.distributed runs: rank 0 checks (it is the rank that writes) and every
    rank raises the same ``OSError``, so call it on every rank, e.g. at start-up, before training.
    Creates the parent directories. Returns ``directory`` as an absolute path.
    """
    directory = Path(directory).absolute()
    problem = first_problem(_writable_problem(directory, required_bytes) if rank() == 0 else None)
    if problem:
        raise OSError(f"cannot write the HF checkpoint {directory}: {problem}")
    return directory


# --- shards -----------------------------------------------------------------------------------


def _save_shard(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """One shard with safetensors' own writer, then fsync (save_file does not)."""
    save_file(tensors, str(path), metadata={"format": "pt"})
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def _plan(entries: list[tuple[str, torch.dtype, tuple[int, ...]]], max_bytes: int) -> list[list[tuple]]:
    """Split the tensors, in order, into shards of at most ``max_bytes`` (a bigger tensor: alone)."""
    shards: list[list[tuple]] = [[]]
    size = 0
    for entry in entries:
        nbytes = _nbytes(entry[1], entry[2])
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


def _shard_names(n: int) -> list[str]:
    return [SAFE_WEIGHTS_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def _config_dict(config: Any, dtype: torch.dtype) -> dict:
    """A ``transformers`` config as it is; ``LlamaArgs`` (or any object with its fields) through
    ``LlamaArgs.to_hf``."""
    data = (config if hasattr(config, "to_dict") else LlamaArgs.from_hf(config).to_hf()).to_dict()
    name = str(dtype).removeprefix("torch.")
    data.update(architectures=["LlamaForCausalLM"], model_type="llama", dtype=name, torch_dtype=name)
    return data


def _write_json(path: Path, data: dict) -> None:
    write_atomic(path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode())


def _replace_dir(tmp: Path, directory: Path) -> None:
    """Move the finished ``tmp`` to ``directory`` (an existing one is replaced), durably."""
    fsync_dir(tmp)
    old = None
    if directory.exists():
        old = directory.parent / f".{directory.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(directory, old)
    os.rename(tmp, directory)
    fsync_dir(directory.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save_hf_checkpoint(
    model: ParallelModel,
    directory: str | Path,
    config: Any = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    dtype: torch.dtype | None = None,
) -> Path | None:
    """Write ``model`` as a ``transformers`` checkpoint directory (collective: every rank calls it).

    ``config``: what ``config.json`` holds, a :class:`~.llama_args.LlamaArgs` (written through
    ``to_hf()``, token ids included) or a ``transformers.LlamaConfig`` (as it is); default
    ``model.args``; checked against ``model.args``. ``max_shard_size``: bytes or
    ``"5GB"``-style.
    ``dtype``: the weights' dtype on disk (default: the parameters'). Returns the directory on
    global rank 0, None elsewhere. Raises the same error on every rank when the location is not
    writable (before any gather) or a write failed.
    """
    config = model.args.to_hf() if config is None else config
    check_hf_config(model.args, config, "the config given")
    state = model.parallel_state
    tp = state.tp
    groups = export_groups(model, dtype)  # every stage's, in order, under pipeline parallelism
    entries = [e for group in groups for e in group.entries]
    total = sum(_nbytes(d, s) for _, d, s in entries)
    directory = check_writable(directory, required_bytes=total + (1 << 20))

    writer = rank() == 0
    if writer and (tp.rank != 0 or state.dp.rank != 0):
        raise RuntimeError(f"global rank 0 is TP rank {tp.rank}, DP rank {state.dp.rank}: expected 0, 0")
    gathers = runtime.is_xla() or state.dp.rank == 0  # see the module docstring
    shards = _plan(entries, parse_size(max_shard_size))
    names = _shard_names(len(shards))
    shard_of = {e[0]: i for i, shard in enumerate(shards) for e in shard}
    error: str | None = None
    tmp = directory.parent / f".{directory.name}.tmp-{uuid.uuid4().hex[:8]}"
    pending: dict[str, torch.Tensor] = {}  # the shard being filled (rank 0, on the host)
    try:
        if writer:
            try:
                tmp.mkdir()
            except OSError as e:  # (raised on every rank below, after the gathers)
                error = f"{type(e).__name__}: {e}"
        for group in groups:
            full = None
            if gathers and group.params is not None:
                with torch.no_grad():
                    full = [(key, hf_conversion.gather(p.detach(), p, tp)) for key, p in group.params]
                    full = [(key, t if dtype is None else t.to(dtype)) for key, t in full]
                runtime.step_boundary()  # XLA: the layer's gathers as one graph, on every rank
            if state.pp_size > 1:
                full = to_rank0(group, full, runtime.get_runtime().device)
            if writer and error is None:
                try:
                    for key, tensor in full:  # type: ignore[union-attr]  # rank 0 gathered or received it
                        pending[key] = tensor.cpu().contiguous()
                        index = shard_of[key]
                        if len(pending) == len(shards[index]):  # shards fill in gather order
                            _save_shard(tmp / names[index], pending)
                            pending = {}
                except Exception as e:  # noqa: BLE001  keep taking part in the gathers; raised on every rank below
                    error = f"{type(e).__name__}: {e}"
            del full
        if writer and error is None:
            try:
                if len(shards) > 1:
                    weight_map = {key: names[i] for key, i in sorted(shard_of.items())}
                    _write_json(tmp / SAFE_INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
                _write_json(tmp / CONFIG_NAME, _config_dict(config, dtype or entries[0][1]))
                _replace_dir(tmp, directory)
            except Exception as e:  # noqa: BLE001  raised on every rank below
                error = f"{type(e).__name__}: {e}"
    finally:
        if writer and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    error = first_problem(error)
    if error:
        raise OSError(f"writing the HF checkpoint {directory} failed on rank 0: {error}")
    return directory if writer else None
