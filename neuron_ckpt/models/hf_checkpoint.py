"""Load a ``transformers`` Llama checkpoint from disk, each rank reading only its own slices.

``load_hf_checkpoint(model, path)`` takes what ``save_pretrained`` writes (a directory with
``config.json`` and ``model.safetensors``, or ``model-0000X-of-0000N.safetensors`` shards with
``model.safetensors.index.json``), or one ``.safetensors`` file. It never materialises the full
state dict: every rank opens the files with ``safetensors.safe_open`` (a memory map), takes its
piece of each tensor with ``get_slice`` along the parameter's partition dimension (rules in
:mod:`.hf_conversion`: rank ``r`` holds piece ``r // replicas``, GQA kv heads included) and
copies it into the parameter. Each tensor is read through its own ``safe_open`` handle, so the
file pages it touched are unmapped before the next one: a rank's host memory for loading is its
shard plus about one tensor (a row-parallel slice touches every page of its tensor), instead of
the whole checkpoint on every rank. Torch ``.bin``/``.pt`` files (and ``pytorch_model.bin``
shards) load the same way through ``torch.load(mmap=True)``; an old non-zip torch file falls
back to a full load.

Keys and full shapes are checked against the model from the file headers, before any parameter
is written (``KeyError`` for missing/unexpected keys, ``ValueError`` for shapes), as
:func:`.hf_conversion.load_hf_state_dict` does. The directory's ``config.json``, when there is
one, is checked against ``model.args`` on the fields that define the model
(:func:`config_differences`); :func:`hf_config_for` reads it, or checks a given config against it.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from . import hf_conversion
from .llama_args import LlamaArgs
from .parallel_model import ParallelModel

CONFIG_NAME = "config.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_INDEX_NAME = "model.safetensors.index.json"
TORCH_WEIGHTS_NAME = "pytorch_model.bin"
TORCH_INDEX_NAME = "pytorch_model.bin.index.json"
TORCH_SUFFIXES = (".bin", ".pt", ".pth")

# LlamaArgs fields a checkpoint's config.json may differ on: how new weights are drawn and the
# training-time dropout change neither the weights' shapes nor the function the loaded weights
# compute. (Nor do the token ids, which LlamaArgs' == leaves out.)
_NOT_COMPARED = ("initializer_range", "attention_dropout")
_ABSENT = object()


# --- config.json ----------------------------------------------------------------------------


def config_differences(config: Any, other: Any) -> dict[str, tuple[Any, Any]]:
    """``{field: (config's value, other's value)}`` for every :class:`~.llama_args.LlamaArgs`
    field that differs (``rope_parameters`` is one field), except the initialisation's
    ``initializer_range`` and the training's ``attention_dropout``.

    ``config`` and ``other``: :class:`~.llama_args.LlamaArgs` or ``transformers`` Llama configs."""
    a, b = LlamaArgs.from_hf(config), LlamaArgs.from_hf(other)
    out = {}
    for f in fields(LlamaArgs):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.compare and f.name not in _NOT_COMPARED and x != y:
            out[f.name] = (x, y)
    return out


def _shown(x: Any, y: Any) -> tuple[Any, Any]:
    """Two dicts (RoPE parameters) cut to the entries that differ; other values as they are."""
    if isinstance(x, dict) and isinstance(y, dict):
        keys = sorted(k for k in x.keys() | y.keys() if x.get(k, _ABSENT) != y.get(k, _ABSENT))
        return {k: x[k] for k in keys if k in x}, {k: y[k] for k in keys if k in y}
    return x, y


def check_hf_config(config: Any, hf_config: Any, source: str = "the checkpoint's config.json") -> None:
    """Raise ``ValueError`` naming every model-defining field where ``config`` and ``hf_config`` differ
    (:func:`config_differences`, with both values; of the RoPE parameters the entries that differ),
    or what ``hf_config`` holds that this library does not build. A ``config`` with more positions
    than the checkpoint's is accepted when that leaves the RoPE tables as they are
    (:func:`.config_file.fit_positions`: training blocks longer than the checkpoint's
    ``max_position_embeddings``, raised as NxD's ``get_model`` does)."""
    try:
        hf_args = LlamaArgs.from_hf(hf_config)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    diff = config_differences(config, hf_args)
    if "max_position_embeddings" in diff and _raised_positions(*diff["max_position_embeddings"], hf_args):
        del diff["max_position_embeddings"]
    if diff:
        shown = {k: _shown(a, b) for k, (a, b) in diff.items()}
        lines = "\n  ".join(f"{k}: model config {a!r}, {source} {b!r}" for k, (a, b) in shown.items())
        raise ValueError(f"the model config does not match {source} on {len(diff)} field(s):\n  {lines}")


def _raised_positions(ours: int, theirs: int, hf_args: LlamaArgs) -> bool:
    """Our ``max_position_embeddings`` is the checkpoint's raised (same RoPE tables, more positions)."""
    from .config_file import fit_positions

    if ours <= theirs:
        return False
    try:
        fit_positions(hf_args, ours)
    except ValueError:
        return False
    return True


def _config_path(path: str | Path) -> Path | None:
    path = Path(path)
    return path / CONFIG_NAME if path.is_dir() and (path / CONFIG_NAME).is_file() else None


def read_hf_config(path: str | Path, notices: list[str] | None = None) -> LlamaArgs | None:
    """The :class:`~.llama_args.LlamaArgs` of a checkpoint directory (its ``config.json``); None when
    ``path`` is a file or a directory without one. ``notices``: as :func:`.config_file.load_llama_config`."""
    config_file = _config_path(path)
    if config_file is None:
        return None
    from .config_file import load_llama_config  # the same checks as --model-config

    return load_llama_config(config_file, notices)


def hf_config_for(path: str | Path, config: Any = None, notices: list[str] | None = None):
    """The config to build the model with before loading ``path``.

    ``config`` given: checked against ``path``'s ``config.json`` when there is one (``ValueError``
    naming each differing field), and returned. ``config`` None: read from ``config.json`` (a
    :class:`~.llama_args.LlamaArgs`); a
    ``ValueError`` when ``path`` has none (a bare weights file: pass a config). ``notices``: as
    :func:`.config_file.load_llama_config`.
    """
    hf_config = read_hf_config(path, notices)
    if config is None:
        if hf_config is None:
            raise ValueError(
                f"{path}: no {CONFIG_NAME} to read the model config from (it is a file, or a directory "
                f"without one): pass a model config (a transformers LlamaConfig JSON)"
            )
        return hf_config
    if hf_config is not None:
        check_hf_config(config, hf_config, f"{_config_path(path)}")
    return config


# --- weight files ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Entry:
    file: Path
    shape: tuple[int, ...]


def _index_files(index_file: Path) -> list[Path]:
    weight_map = json.loads(index_file.read_text()).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index_file}: no 'weight_map' object")
    files = sorted(set(weight_map.values()))
    absent = [f for f in files if not (index_file.parent / f).is_file()]
    if absent:
        raise FileNotFoundError(f"{index_file} names shard files that do not exist: {absent}")
    return [index_file.parent / f for f in files]


def weight_files(path: str | Path) -> list[Path]:
    """The weight files of a checkpoint directory (as ``save_pretrained`` names them), or ``[path]``."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"HF checkpoint {path} does not exist")
    for name in (SAFE_INDEX_NAME, TORCH_INDEX_NAME):
        if (path / name).is_file():
            return _index_files(path / name)
    for name in (SAFE_WEIGHTS_NAME, TORCH_WEIGHTS_NAME):
        if (path / name).is_file():
            return [path / name]
    found = sorted(path.glob("*.safetensors"))
    if len(found) == 1:
        return found
    raise FileNotFoundError(
        f"{path}: no {SAFE_INDEX_NAME}, {SAFE_WEIGHTS_NAME}, {TORCH_INDEX_NAME} or {TORCH_WEIGHTS_NAME}"
        + (f" (and {len(found)} other .safetensors files: pass one)" if found else "")
    )


def _is_safetensors(file: Path) -> bool:
    return file.suffix == ".safetensors"


def _torch_load(file: Path, mmap: bool) -> dict[str, torch.Tensor]:
    return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)


def _scan(files: list[Path]) -> tuple[dict[str, _Entry], dict[Path, dict[str, torch.Tensor]]]:
    """Key -> (file, full shape) from the headers; plus the fully loaded dicts of old torch files."""
    entries: dict[str, _Entry] = {}
    loaded: dict[Path, dict[str, torch.Tensor]] = {}
    for file in files:
        if _is_safetensors(file):
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as f:
                shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        elif file.suffix in TORCH_SUFFIXES:
            try:
                sd = _torch_load(file, mmap=True)
            except RuntimeError:  # not a zip-format file: it cannot be memory-mapped
                warnings.warn(
                    f"{file}: an old-format torch file cannot be memory-mapped; every rank loads it whole",
                    stacklevel=3,
                )
                sd = loaded[file] = _torch_load(file, mmap=False)
            shapes = {k: tuple(v.shape) for k, v in sd.items()}
            del sd
        else:
            raise ValueError(f"{file}: not a .safetensors or torch ({', '.join(TORCH_SUFFIXES)}) weights file")
        for key, shape in shapes.items():
            if key in entries:
                raise ValueError(f"{key} is in both {entries[key].file} and {file}")
            entries[key] = _Entry(file, shape)
    return entries, loaded


def _index(rng: tuple[int, int, int] | None) -> tuple[slice, ...]:
    if rng is None:
        return (slice(None),)
    dim, start, stop = rng
    return (slice(None),) * dim + (slice(start, stop),)


def load_hf_checkpoint(model: ParallelModel, path: str | Path) -> None:
    """Copy this rank's slices of the ``transformers`` checkpoint at ``path`` into ``model``.

    ``path``: a ``save_pretrained`` directory or one weights file (see the module docstring).
    Every rank calls it (no collective: each reads the files itself). ``model.args`` is compared
    with the directory's ``config.json`` first. Raises before writing any
    parameter: ``ValueError`` for a config mismatch, ``KeyError`` for missing/unexpected keys,
    ``ValueError`` listing every shape mismatch.
    """
    local = {key: p for key, (_, p) in hf_conversion.expected_hf_keys(model).items()}
    load_hf_slices(model.args, model.parallel_state.tp, local, set(local), path)


def load_hf_slices(
    args: LlamaArgs, tp: Any, local: dict[str, torch.nn.Parameter], whole: set[str], path: str | Path
) -> None:
    """:func:`load_hf_checkpoint` for a rank that holds part of the model (a pipeline's stages):
    ``local`` maps ``transformers`` keys to this rank's parameters (``tp``: their tensor-parallel
    group), ``whole`` is every key of the model, against which the checkpoint's keys are checked."""
    hf_config = read_hf_config(path, notices=[])  # compared only; hf_config_for gave its notices
    if hf_config is not None:
        check_hf_config(args, hf_config, str(_config_path(path)))
    entries, loaded = _scan(weight_files(path))
    shapes = {k: e.shape for k, e in entries.items()}
    hf_conversion.check_keys_and_shapes(local, whole, args, tp.size, shapes, f"checkpoint {path}")
    files = list(dict.fromkeys(e.file for e in entries.values()))
    order = sorted(local, key=lambda k: files.index(entries[k].file))  # file by file, model order within
    with torch.no_grad():
        for key in order:
            p = local[key]
            piece = _read(entries[key].file, key, _index(hf_conversion.shard_range(p, tp.rank, tp.size)), loaded)
            p.copy_(piece.to(dtype=p.dtype).to(device=p.device))  # cast on the host: no graph on XLA
            del piece  # (and its file mapping, before the next tensor)


def _read(file: Path, key: str, index: tuple[slice, ...], loaded: dict) -> torch.Tensor:
    """One tensor's slice; a view of a fresh memory map, released when the caller drops it."""
    if file in loaded:
        return loaded[file][key][index]
    if _is_safetensors(file):
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as f:
            return f.get_slice(key)[index]
    return _torch_load(file, mmap=True)[key][index]
