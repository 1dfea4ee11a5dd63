"""Sharded training checkpoints: the model once per TP rank, the rest per rank, committed atomically.

Layout (format 2) under ``directory`` (a filesystem every rank sees, e.g. FSx on a cluster)::

    step_00000100/
        meta.json                   format, step, layout, size of every file; written last (rank 0)
        model_tp00000.safetensors   TP rank 0's model slice, written by DP rank 0 of that TP rank only
        model_tp00001.safetensors   ... one per TP rank (the model is the same on every DP rank)
        rank_00000.safetensors      rank 0's own tensors: its ZeRO-1 optimizer slices
        rank_00000.pt               rank 0's structure and small state: data order, RNG streams
        ...                         rank_{r}.safetensors and rank_{r}.pt for every rank r
        <every file>.sha256         sha256 of the file beside it
    latest                          text: the name of the newest complete checkpoint

Which entries of the saved state are the same on every DP rank is ``shared_keys`` (default:
``"model"``): each such entry must be a flat ``{name: tensor}`` dict (a ``state_dict()``) and is
written once per TP rank, by its DP rank 0, to ``{key}_tp{tp_rank}.safetensors``. Every rank
reads the file of its own TP rank back, whatever its DP rank. Everything else is the rank's own:
its tensors (anywhere inside nested dicts, lists and tuples) go to ``rank_{r}.safetensors``,
and the structure around them (tensors replaced by :class:`TensorRef`), numbers, strings and
RNG snapshots to ``rank_{r}.pt`` (``torch.save``).

The ``.safetensors`` files are in the safetensors layout (8-byte header length, JSON header
with every tensor's dtype, shape and byte range, then the raw bytes) and are written as a
stream: the header is known from the tensors' shapes without touching their data, then the
tensors are copied to host memory a group of at most ``chunk_mb`` at a time (a tensor larger
than that alone), written and dropped. A rank's host memory for a save is one group, not its
whole shard. (A group is whole tensors: on XLA slicing a device tensor would run a graph.)

At most ``writers`` ranks per host write at the same time: ranks write in rounds by local rank
(round ``local_rank // writers``), separated by :func:`runtime.barrier`. The default, 8, is
NxD's (``neuronx_distributed`` ``save_checkpoint(num_workers=8)``): a trn1.32xlarge host
runs 32 ranks, so 4 rounds, each rank holding at most one ``chunk_mb`` group on the host while
its round writes. ``writers=0``: every rank at once. :meth:`CheckpointManager.restore`
(resuming) reads in the same rounds, each rank handing its state to the model and optimizer
before the next round reads.

A save never leaves something that looks complete but is not: every rank writes into
``.tmp_step_...`` (temp file, fsync, rename, then the ``.sha256`` beside it), all ranks agree
that every write succeeded, then rank 0 checks every expected file is there, writes
``meta.json``, fsyncs and renames the directory to ``step_...`` and only then replaces
``latest`` (temp file + fsync + ``os.replace`` + directory fsync). A crash at any point leaves
``latest`` on the previous complete checkpoint. Checkpoints beyond the newest ``keep_last`` are
then deleted. A rank whose write fails still takes part in every round, and then every rank
raises, so no rank is left waiting in a collective.

Loading checks before deserialising anything: ``meta.json`` must parse, have this format and
match the run's layout; each file must match the sha256 written beside it (computed while it
was written, and again while it is read), so a truncated or bit-flipped file is a
``ValueError`` naming the file. ``.pt`` files are read with ``torch.load(weights_only=True)``
(tensors, plain containers and :data:`SAFE_GLOBALS` only, no code); ``.safetensors`` files are
parsed here (JSON header, raw bytes) and never run code either.

A shard holds only this rank's tensor-parallel slice of the model and its ZeRO-1 slice of the
optimizer, so a checkpoint loads only at the tensor- and data-parallel sizes it was saved at;
:meth:`CheckpointManager.load` refuses any other layout with a message saying what differs and
how to move weights to another layout (through a ``transformers`` state dict).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import shutil
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from ..distributed import runtime
from ..distributed.random import RNGState

LATEST = "latest"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_FORMAT_NAME = "neuron_ckpt.train.checkpoint"
FORMAT_VERSION = 2
FORMAT = f"{_FORMAT_NAME}/{FORMAT_VERSION}"
DEFAULT_WRITERS = 8
DEFAULT_CHUNK_MB = 256.0
_MAX_HEADER = 100 << 20  # the safetensors limit on a header


@dataclass(frozen=True)
class TensorRef:
    """Stands in ``rank_{r}.pt`` for the tensor stored under ``key`` in ``rank_{r}.safetensors``."""

    key: str


SAFE_GLOBALS = [RNGState, TensorRef]  # the only non-container classes a ``.pt`` file holds

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"),
                     ("uint32", "U32"), ("uint64", "U64")):  # fmt: skip
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _code
_DTYPE_OF = {code: dtype for dtype, code in _DTYPES.items()}


# ---- files -------------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _write_with_digest(path: Path, write) -> None:
    """``write(put)`` streams bytes through ``put``; the file and its ``.sha256`` are committed."""
    digest = hashlib.sha256()

    def body(f):
        def put(data) -> None:
            f.write(data)
            digest.update(data)

        write(put)

    _write_atomic(path, body)
    _write_atomic(_sidecar(path), lambda f: f.write(digest.hexdigest().encode()))


def _corrupt(path: Path, why: str) -> ValueError:
    return ValueError(
        f"{path}: {why}: the file is truncated or corrupt; resume from an earlier checkpoint"
    )


def _recorded_digest(path: Path) -> str:
    try:
        want = _sidecar(path).read_text().strip()
        if not path.is_file():
            raise FileNotFoundError(f"no such file: {path.name}")
    except OSError as e:
        raise ValueError(f"{path}: missing or unreadable checkpoint file ({e})") from None
    return want


def _check_digest(path: Path, got: str, want: str) -> None:
    if got != want:
        raise _corrupt(path, f"sha256 {got[:12]}... does not match the {want[:12]}... recorded when it was written")


def to_cpu(obj: Any) -> Any:
    """Tensors (device or XLA) copied to CPU inside nested dicts/lists, so torch.save is portable."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def _to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One group of tensors copied to host memory (CPU tensors are used as they are)."""
    return [t.detach().to("cpu") for t in tensors]


def _groups(tensors: list[tuple[str, torch.Tensor]], limit: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs of tensors of at most ``limit`` bytes (a larger tensor forms its own)."""
    group, size = [], 0
    for name, t in tensors:
        n = t.numel() * t.element_size()
        if group and size + n > limit:
            yield group
            group, size = [], 0
        group.append((name, t))
        size += n
    if group:
        yield group


def _raw(t: torch.Tensor):
    """The bytes of a CPU tensor, as a buffer (no copy when it is contiguous)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def _write_tensor_file(path: Path, tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str], chunk_bytes: int) -> None:
    """``tensors`` (device or CPU) as a safetensors file, moved to host ``chunk_bytes`` at a time."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **metadata}}
    offset = 0
    for name, t in tensors:
        if t.dtype not in _DTYPES:
            raise TypeError(f"{path.name}: tensor {name!r} has dtype {t.dtype}, which a checkpoint cannot store")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)

    def write(put) -> None:
        put(struct.pack("<Q", len(head)))
        put(head)
        for group in _groups(tensors, chunk_bytes):
            host = _to_host([t for _, t in group])
            for t in host:
                if t.numel():
                    put(_raw(t))
            del host

    _write_with_digest(path, write)


def _read_tensor_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(tensors in file order, metadata)`` of a file :func:`_write_tensor_file` wrote, checked
    against its ``.sha256`` while it is read (one pass)."""
    want = _recorded_digest(path)
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            if len(raw) < 8:
                raise _corrupt(path, f"{size} bytes, shorter than a header")
            (n,) = struct.unpack("<Q", raw)
            if n > min(size - 8, _MAX_HEADER):
                raise _corrupt(path, f"header of {n} bytes in a file of {size}")
            head = f.read(n)
            digest.update(raw)
            digest.update(head)
            entries = _parse_header(path, head, size - 8 - n)
            tensors: dict[str, torch.Tensor] = {}
            for name, dtype, shape, nbytes in entries:
                t = torch.empty(shape, dtype=dtype)
                if nbytes:
                    buf = _raw(t)
                    if f.readinto(memoryview(buf)) != nbytes:
                        raise _corrupt(path, "ends inside a tensor")
                    digest.update(buf)
                tensors[name] = t
    except OSError as e:
        raise ValueError(f"{path}: missing or unreadable checkpoint file ({e})") from None
    _check_digest(path, digest.hexdigest(), want)
    metadata = json.loads(head).get("__metadata__") or {}
    return tensors, metadata


def _parse_header(path: Path, head: bytes, data_bytes: int) -> list[tuple[str, torch.dtype, list[int], int]]:
    """Validated ``(name, dtype, shape, bytes)`` in file order; tensors tile the data exactly."""
    try:
        header = json.loads(head)
        entries = []
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = _DTYPE_OF[info["dtype"]]
            shape = [int(s) for s in info["shape"]]
            begin, end = (int(x) for x in info["data_offsets"])
            itemsize = torch.empty((), dtype=dtype).element_size()
            if any(s < 0 for s in shape) or end - begin != math.prod(shape) * itemsize:
                raise ValueError(name)
            entries.append((begin, end, name, dtype, shape))
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise _corrupt(path, f"unreadable header ({type(e).__name__}: {e})") from None
    entries.sort(key=lambda e: e[0])
    offset = 0
    for begin, end, name, *_ in entries:
        if begin != offset:
            raise _corrupt(path, f"tensor {name!r} at byte {begin}, expected {offset}")
        offset = end
    if offset != data_bytes:
        raise _corrupt(path, f"header describes {offset} bytes of tensors, the file holds {data_bytes}")
    return [(name, dtype, shape, end - begin) for begin, end, name, dtype, shape in entries]


def _write_pt(path: Path, obj: Any) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    _write_with_digest(path, lambda put: put(data))


def _read_pt(path: Path) -> Any:
    want = _recorded_digest(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"{path}: missing or unreadable checkpoint file ({e})") from None
    _check_digest(path, hashlib.sha256(data).hexdigest(), want)
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def _split(obj: Any, path: str, out: dict[str, torch.Tensor]) -> Any:
    """``obj`` with every tensor inside dicts/lists/tuples moved into ``out`` (a TensorRef left)."""
    if isinstance(obj, torch.Tensor):
        key = path or "tensor"
        while key in out:
            key += "'"
        out[key] = obj
        return TensorRef(key)
    if isinstance(obj, dict):
        items = {k: _split(v, f"{path}/{k}" if path else str(k), out) for k, v in obj.items()}
        return OrderedDict(items) if isinstance(obj, OrderedDict) else items
    if isinstance(obj, (list, tuple)):
        return type(obj)(_split(v, f"{path}/{i}" if path else str(i), out) for i, v in enumerate(obj))
    return obj


def _join(obj: Any, tensors: dict[str, torch.Tensor], path: Path) -> Any:
    if isinstance(obj, TensorRef):
        if obj.key not in tensors:
            raise _corrupt(path, f"no tensor {obj.key!r}")
        return tensors[obj.key]
    if isinstance(obj, dict):
        items = {k: _join(v, tensors, path) for k, v in obj.items()}
        return OrderedDict(items) if isinstance(obj, OrderedDict) else items
    if isinstance(obj, (list, tuple)):
        return type(obj)(_join(v, tensors, path) for v in obj)
    return obj


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


# ---- collectives (host side) -------------------------------------------------------------------


def _all_max(value: int) -> int:
    """The max of ``value`` over all ranks, on the host (XLA: through the runtime's gloo group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    try:
        rt = runtime.get_runtime()
        group, backend = rt.host_group, rt.backend
    except RuntimeError:
        group, backend = None, dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if group is None and backend == "nccl" else torch.device("cpu")
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def _agree(error: BaseException | None, what: str) -> None:
    """A collective: raise ``error`` here, or a RuntimeError if it failed on another rank."""
    failed = _all_max(1 if error is not None else 0)
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"{what} failed on another rank (its error is in that rank's output)")


# ---- the manager -------------------------------------------------------------------------------


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def rank_file(rank: int, suffix: str) -> str:
    return f"rank_{rank:05d}{suffix}"


def shared_file(key: str, tp_rank: int) -> str:
    return f"{key}_tp{tp_rank:05d}.safetensors"


@dataclass
class SaveReport:
    """What one :meth:`CheckpointManager.save` wrote (sizes known on rank 0 only)."""

    path: Path
    step: int
    seconds: float
    total_bytes: int = 0
    shared_bytes: int = 0
    files: int = 0
    rounds: int = 1

    def describe(self) -> str:
        return (
            f"checkpoint {self.path.name}: {_human(self.total_bytes)} on disk in {self.files} files "
            f"(model {_human(self.shared_bytes)}, per-rank {_human(self.total_bytes - self.shared_bytes)}), "
            f"saved in {self.seconds:.2f} s ({self.rounds} writer round{'s' * (self.rounds > 1)})"
        )


class CheckpointManager:
    """Save / find / load the sharded checkpoints of one run. Every rank constructs one.

    ``parallel_state`` (anything with ``tp_rank``, ``tp_size``, ``dp_rank``, ``dp_size``; default:
    the initialised model parallel state, or a single rank) says which rank writes the model
    file of which TP rank. ``local_rank`` (default: the runtime's) picks the writer round;
    ``writers`` ranks per host write at a time (0: all). ``chunk_mb``: the most tensor data a
    rank holds on the host at once while writing. ``log(message)`` (rank 0) gets one line per
    save: its size on disk and time.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        keep_last: int = 3,
        rank: int = 0,
        world_size: int = 1,
        *,
        parallel_state: Any = None,
        local_rank: int | None = None,
        writers: int = DEFAULT_WRITERS,
        chunk_mb: float = DEFAULT_CHUNK_MB,
        shared_keys: tuple[str, ...] = ("model",),
        log: Callable[[str], None] | None = None,
    ):
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        if writers < 0:
            raise ValueError(f"writers must be >= 0 (0: all ranks of a host at once), got {writers}")
        if chunk_mb <= 0:
            raise ValueError(f"chunk_mb must be > 0, got {chunk_mb}")
        self.directory = Path(directory)
        self.keep_last, self.rank, self.world_size = keep_last, rank, world_size
        if parallel_state is None and world_size > 1:
            from ..distributed.parallel_state import get_parallel_state

            try:
                parallel_state = get_parallel_state()
            except (RuntimeError, ValueError):
                raise ValueError(
                    f"CheckpointManager at world size {world_size} needs parallel_state= (or an initialised "
                    "model parallel state): it decides which rank writes the model file of each TP rank"
                ) from None
        if parallel_state is None:
            self.tp_rank, self.tp_size, self.dp_rank, dp_size = 0, 1, 0, 1
        else:
            ps = parallel_state
            self.tp_rank, self.tp_size, self.dp_rank, dp_size = ps.tp_rank, ps.tp_size, ps.dp_rank, ps.dp_size
        if self.tp_size * dp_size != world_size:
            raise ValueError(f"TP {self.tp_size} x DP {dp_size} != world size {world_size}")
        self.dp_size = dp_size
        if local_rank is None:
            try:
                local_rank = runtime.get_runtime().local_rank
            except RuntimeError:
                local_rank = 0
        self.local_rank, self.writers = local_rank, writers
        self.chunk_bytes = max(1, int(chunk_mb * 2**20))
        self.shared_keys = tuple(shared_keys)
        self.log = log
        self._rounds: int | None = None
        self.write_spans: list[tuple[float, float]] = []
        """(start, end) of this rank's writing in each save, ``time.monotonic()`` (the same
        clock for every process of a host)."""
        self.last_save: SaveReport | None = None

    def _shard_name(self, rank: int) -> str:
        return rank_file(rank, ".pt")

    def complete(self) -> list[Path]:
        """Complete checkpoints (directories with ``meta.json``), oldest first."""
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir() if _STEP_DIR.match(p.name) and (p / "meta.json").is_file()]
        return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))

    def rounds(self) -> tuple[int, int]:
        """``(number of writer rounds, this rank's round)``. The first call is a collective."""
        if self.writers == 0:
            return 1, 0
        if self._rounds is None:
            local_ranks = _all_max(self.local_rank) + 1  # ranks on the fullest host
            self._rounds = -(-local_ranks // self.writers)
        return self._rounds, self.local_rank // self.writers

    def _in_rounds(self, work: Callable[[], None], what: str) -> None:
        """Run ``work`` in this rank's round (all ranks call this); failures raised everywhere."""
        rounds, mine = self.rounds()
        error = None
        for r in range(rounds):
            if r == mine:
                try:
                    work()
                except BaseException as e:  # noqa: BLE001  re-raised below, after every round
                    error = e
            if r < rounds - 1:
                runtime.barrier()
        _agree(error, what)

    def save(self, step: int, shard: dict[str, Any], meta: dict[str, Any]) -> Path:
        """Write this rank's ``shard``; rank 0 also writes ``meta``. A collective: all ranks call it.

        ``shard[k]`` for ``k`` in ``shared_keys`` (the model) is written by DP rank 0 only, to the
        file of this TP rank; the rest by every rank.
        """
        start = time.perf_counter()
        name = step_dir_name(step)
        final, tmp = self.directory / name, self.directory / f".tmp_{name}"
        shared = {k: shard[k] for k in self.shared_keys if k in shard}
        own = {k: v for k, v in shard.items() if k not in shared}
        error = None
        if self.rank == 0:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
            except OSError as e:
                error = e
        _agree(error, f"creating {tmp}")

        def write() -> None:
            began = time.monotonic()
            if self.dp_rank == 0:
                for key, tensors in shared.items():
                    self._write_shared(tmp / shared_file(key, self.tp_rank), key, tensors)
            tensors: dict[str, torch.Tensor] = {}
            skeleton = _split(own, "", tensors)
            info = {"rank": str(self.rank), "tp_rank": str(self.tp_rank), "dp_rank": str(self.dp_rank)}
            _write_tensor_file(tmp / rank_file(self.rank, ".safetensors"), list(tensors.items()), info, self.chunk_bytes)
            _write_pt(tmp / rank_file(self.rank, ".pt"), skeleton)
            self.write_spans.append((began, time.monotonic()))

        self._in_rounds(write, f"writing checkpoint {tmp}")
        report, error = SaveReport(final, step, 0.0, rounds=self.rounds()[0]), None
        if self.rank == 0:
            try:
                self._commit(tmp, final, step, meta, list(shared), report)
            except BaseException as e:  # noqa: BLE001  re-raised by _agree
                error = e
        _agree(error, f"committing checkpoint {tmp}")
        report.seconds = time.perf_counter() - start
        self.last_save = report
        if self.rank == 0 and self.log is not None:
            self.log(report.describe())
        return final

    def _write_shared(self, path: Path, key: str, tensors: Any) -> None:
        if not isinstance(tensors, dict) or not all(isinstance(v, torch.Tensor) for v in tensors.values()):
            raise TypeError(f"checkpoint entry {key!r} is shared by the DP ranks, so must be a flat {{name: tensor}} state dict")
        info = {"key": key, "rank": str(self.rank), "tp_rank": str(self.tp_rank), "dp_rank": str(self.dp_rank)}
        _write_tensor_file(path, [(str(k), v) for k, v in tensors.items()], info, self.chunk_bytes)

    def _commit(self, tmp: Path, final: Path, step: int, meta: dict[str, Any], shared: list[str], report: SaveReport) -> None:
        shared_files = {key: [shared_file(key, t) for t in range(self.tp_size)] for key in shared}
        expected = [rank_file(r, s) for r in range(self.world_size) for s in (".safetensors", ".pt")]
        expected += [f for files in shared_files.values() for f in files]
        missing = [f for f in expected if not _sidecar(tmp / f).is_file()]
        if missing:
            raise RuntimeError(f"checkpoint {tmp}: {len(missing)} files not written: {', '.join(missing[:8])}")
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
        full_meta = {
            "format": FORMAT, "step": step, "world_size": self.world_size, "tp_size": self.tp_size,
            "dp_size": self.dp_size, **meta, "shared": shared_files, "files": files,
        }  # fmt: skip
        _write_atomic(tmp / "meta.json", lambda f: f.write(json.dumps(full_meta, indent=1).encode()))
        _fsync_dir(tmp)
        if final.exists():  # the same step saved again (e.g. after a resume): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_atomic(self.directory / LATEST, lambda f: f.write(final.name.encode()))
        _fsync_dir(self.directory)
        self._prune()
        report.total_bytes = sum(files.values()) + (final / "meta.json").stat().st_size
        report.shared_bytes = sum(files[f] + files[f + ".sha256"] for fs in shared_files.values() for f in fs)
        report.files = len(files) + 1

    def _prune(self) -> None:
        keep = self.complete()[-self.keep_last :]
        for path in self.complete():
            if path not in keep:
                shutil.rmtree(path, ignore_errors=True)

    def resolve(self, which: str) -> Path | None:
        """``"latest"`` -> the checkpoint ``latest`` names (None if there is none yet); else a path."""
        if which == LATEST:
            pointer = self.directory / LATEST
            if not pointer.is_file():
                return None
            path = self.directory / pointer.read_text().strip()
        else:
            path = Path(which)
        if not (path / "meta.json").is_file():
            raise FileNotFoundError(f"{path} is not a complete checkpoint (no meta.json)")
        return path

    def read_meta(self, path: Path) -> dict[str, Any]:
        """``meta.json`` of the checkpoint at ``path``, refused unless it is this format."""
        try:
            meta = json.loads((path / "meta.json").read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path / 'meta.json'}: unreadable checkpoint metadata ({e})") from None
        got = meta.get("format") if isinstance(meta, dict) else meta
        if got == FORMAT:
            return meta
        if isinstance(got, str) and got.startswith(_FORMAT_NAME + "/"):
            raise ValueError(
                f"{path / 'meta.json'}: checkpoint format {got!r}, but this version of neuron_ckpt reads "
                f"{FORMAT!r} only (format 1 stored the whole model slice in every rank's file; format 2 "
                "stores it once per TP rank, in model_tp*.safetensors). Continue that run with the "
                "neuron_ckpt version that wrote it, or export its weights there (train.py --export-hf "
                "weights.safetensors --max-steps <its step> --resume <it>) and start from them here with "
                "--init-hf weights.safetensors (optimizer state starts fresh)."
            )
        raise ValueError(f"{path / 'meta.json'}: format must be {FORMAT!r}, got {got!r}")

    def load(self, path: Path, expect: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(shard, meta)`` of this rank; ``expect`` fields (tp_size, dp_size, ...) must match meta.

        ``shard`` has this rank's own entries and the shared ones (the model) from the file of
        this rank's TP rank. Not a collective; :meth:`restore` reads in writer rounds.
        """
        meta = self.read_meta(path)
        expect = {"world_size": self.world_size, **expect}
        diffs = {k: (meta.get(k), v) for k, v in expect.items() if meta.get(k) != v}
        if diffs:
            said = ", ".join(f"{k}: checkpoint {a!r}, this run {b!r}" for k, (a, b) in diffs.items())
            raise ValueError(
                f"cannot resume from {path}: {said}. A sharded checkpoint holds per-rank tensor-parallel "
                "weight slices and ZeRO-1 optimizer slices, so it loads only at the layout it was saved "
                "with. To change the layout, export the weights at the old layout (train.py --export-hf "
                "weights.safetensors --max-steps <the checkpoint's step> --resume latest) and start the new "
                "run from them with --init-hf weights.safetensors (optimizer state starts fresh)."
            )
        skeleton = _read_pt(path / rank_file(self.rank, ".pt"))
        tensor_path = path / rank_file(self.rank, ".safetensors")
        tensors, _ = _read_tensor_file(tensor_path)
        shard = _join(skeleton, tensors, tensor_path)
        for key, files in (meta.get("shared") or {}).items():
            name = shared_file(key, self.tp_rank)
            if name not in files:
                raise ValueError(f"{path}: no {key!r} file for TP rank {self.tp_rank} (has {files})")
            shard[key], _ = _read_tensor_file(path / name)
        return shard, meta

    def restore(self, path: Path, expect: dict[str, Any], apply: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        """A collective: :meth:`load` this rank's state and ``apply(shard)`` it, in writer rounds
        (at most ``writers`` ranks per host hold a shard on the host at once). Returns meta."""
        out: dict[str, Any] = {}

        def read() -> None:
            shard, out["meta"] = self.load(path, expect)
            apply(shard)

        self._in_rounds(read, f"restoring checkpoint {path}")
        return out["meta"]
