"""Host memory per rank and checkpoint bytes on disk: what the device budget leaves out.

A trn1.32xlarge runs 32 ranks on one host with 512 GiB, so 16 GiB per rank, and every rank
passes through the same host-heavy moments at about the same time. Each line below is one such
moment (they happen at different times, so they do not add up):

* **model construction**: ``LlamaForCausalLM`` is built on the host in the model dtype before
  ``.to(device)``, and each weight is drawn whole in fp32 (TP-independent initialisation,
  :mod:`neuron_ckpt.parallel.init`) before the rank keeps its slice: the local parameters plus
  the largest full weight in fp32. Every rank at once.
* **``--init-hf`` load**: each rank maps one tensor of the checkpoint at a time and copies its
  slice (:mod:`neuron_ckpt.models.hf_checkpoint`): about the largest full tensor plus its slice.
  (Loading the whole state dict on every rank, as before, costs the whole checkpoint per rank.)
* **checkpoint save**: tensors go to the host one group of at most ``chunk_mb`` at a time
  (:mod:`neuron_ckpt.train.tensor_files`), and at most ``writers`` ranks per host write at once.
* **activation offload** (``offload_modules``, :mod:`.offload`): the pinned blocks of every
  offloaded storage of the micro-batches in flight. torch's caching host allocator keeps them
  from the first step on, so they are also held at every checkpoint save after it.

Checkpoint size on disk per step: the model once per TP rank (DP rank 0 writes it) in the model
dtype, plus every rank's ZeRO-1 slice of the fp32 master weights and AdamW's two moments.
"""

from __future__ import annotations

from dataclasses import dataclass

from .budget import GIB
from .shape import ModelShape, TrainingSetup

_FP32 = 4
_MB = 1 << 20


@dataclass(frozen=True)
class Instance:
    """One host: its memory and how many ranks (one per NeuronCore) share it."""

    name: str
    memory_bytes: int
    ranks: int

    @property
    def per_rank_bytes(self) -> int:
        return self.memory_bytes // self.ranks


INSTANCES = {
    "trn1.32xlarge": Instance("trn1.32xlarge", 512 * GIB, 32),
    "trn1.2xlarge": Instance("trn1.2xlarge", 32 * GIB, 2),
    # A GPU host, where offload runs (streams, pinned memory): 8 H100, one rank each.
    "p5.48xlarge": Instance("p5.48xlarge", 2048 * GIB, 8),
}


def largest_full_weight(model: ModelShape) -> int:
    """Elements of the largest whole weight (embedding / LM head, an MLP or attention matrix)."""
    h = model.hidden
    return max(model.vocab * h, model.ffn * h, model.heads * model.head_dim * h)


@dataclass(frozen=True)
class HostMoment:
    name: str
    per_rank: int
    per_host: int
    note: str


@dataclass(frozen=True)
class HostBudget:
    """Host bytes at each host-heavy moment, and what a checkpoint costs on disk."""

    instance: Instance
    moments: tuple[HostMoment, ...]
    checkpoint_model_bytes: int
    checkpoint_optimizer_bytes: int
    keep_last: int

    @property
    def checkpoint_bytes(self) -> int:
        """One checkpoint (one step) on disk, all ranks."""
        return self.checkpoint_model_bytes + self.checkpoint_optimizer_bytes

    @property
    def peak_per_rank(self) -> int:
        return max(m.per_rank for m in self.moments)

    @property
    def fits(self) -> bool:
        return all(m.per_host <= self.instance.memory_bytes for m in self.moments)

    def table(self) -> str:
        i = self.instance
        lines = [
            (
                f"host memory ({i.name}: {i.memory_bytes / GIB:.0f} GiB for {i.ranks} ranks, "
                f"{i.per_rank_bytes / GIB:.2f} GiB per rank):"
            ),
            f"{'moment':<22}{'GiB/rank':>9}{'GiB/host':>10}  note",
        ]
        for m in self.moments:
            lines.append(f"{m.name:<22}{m.per_rank / GIB:>9.2f}{m.per_host / GIB:>10.2f}  {m.note}")
        in_flight = (self.keep_last + 1) * self.checkpoint_bytes
        lines.append(
            f"checkpoint on disk per step: {self.checkpoint_bytes / GIB:.1f} GiB (model "
            f"{self.checkpoint_model_bytes / GIB:.1f} GiB, once per TP rank; optimizer "
            f"{self.checkpoint_optimizer_bytes / GIB:.1f} GiB); keep-last {self.keep_last} + 1 being written: "
            f"{in_flight / GIB:.1f} GiB"
        )
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "instance": self.instance.name,
            "per_rank_limit_gib": round(self.instance.per_rank_bytes / GIB, 4),
            "moments": [
                {
                    "name": m.name,
                    "per_rank_gib": round(m.per_rank / GIB, 4),
                    "per_host_gib": round(m.per_host / GIB, 4),
                    "note": m.note,
                }
                for m in self.moments
            ],
            "checkpoint_gib": round(self.checkpoint_bytes / GIB, 4),
            "checkpoint_model_gib": round(self.checkpoint_model_bytes / GIB, 4),
            "checkpoint_optimizer_gib": round(self.checkpoint_optimizer_bytes / GIB, 4),
            "fits": self.fits,
        }


def host_budget(
    model: ModelShape,
    setup: TrainingSetup,
    instance: str = "trn1.32xlarge",
    chunk_mb: float = 256.0,
    writers: int = 8,
    keep_last: int = 3,
    offload_pinned_bytes: int = 0,
) -> HostBudget:
    """The host moments of ``model`` trained as ``setup`` on ``instance`` (a name in
    :data:`INSTANCES`); ``chunk_mb``, ``writers``, ``keep_last``: the checkpoint settings
    (``CheckpointManager`` defaults; ``writers=0``: every rank at once); ``offload_pinned_bytes``:
    each rank's pinned blocks for activation offload (:attr:`.offload.OffloadPrice.host_pinned_bytes`)."""
    if instance not in INSTANCES:
        raise ValueError(f"instance must be one of {sorted(INSTANCES)}, got {instance!r}")
    host = INSTANCES[instance]
    ranks = min(host.ranks, setup.tp * setup.dp)
    n = model.local_parameters(setup.tp)
    w = setup.width
    full = largest_full_weight(model)
    construct = n * w + full * _FP32
    load = full * w + -(-full // setup.tp) * w
    group = int(chunk_mb * _MB)
    writing = ranks if writers == 0 else min(writers, ranks)
    held = offload_pinned_bytes
    offload = (
        HostMoment(
            "activation offload",
            held,
            held * ranks,
            "pinned blocks (a power of two each) of the offloaded activations in flight, kept all run",
        ),
    )
    moments = (
        HostMoment(
            "model construction",
            construct,
            construct * ranks,
            f"local parameters ({setup.dtype}) + the largest weight drawn whole in fp32; {ranks} ranks at once",
        ),
        HostMoment(
            "--init-hf load", load, load * ranks, "one checkpoint tensor mapped at a time + this rank's slice of it"
        ),
        HostMoment(
            "checkpoint save",
            group + held,
            group * writing + held * ranks,
            f"one group of <= {chunk_mb:g} MiB per writing rank, {writing} writers per host"
            + (", beside the offload's pinned blocks" if held else ""),
        ),
        *(offload if held else ()),
    )
    world = setup.tp * setup.dp
    per_shard = -(-n // setup.optimizer_shards)
    state = (3 if setup.keeps_master_weights else 2) * _FP32  # fp32 master, exp_avg, exp_avg_sq
    optimizer = world * per_shard * state
    return HostBudget(host, moments, setup.tp * n * w, optimizer, keep_last)


def offload_room(
    model: ModelShape, setup: TrainingSetup, instance: str, chunk_mb: float = 256.0, writers: int = 8
) -> int:
    """The most pinned bytes per rank activation offload may hold on ``instance``: its blocks stay
    all run, so beside the heaviest moment they share the host with, a checkpoint save (model
    construction and loading come before the first step); what the host has less that save, over
    its ranks."""
    plain = host_budget(model, setup, instance, chunk_mb, writers)
    save = next(m for m in plain.moments if m.name == "checkpoint save")
    ranks = min(plain.instance.ranks, setup.tp * setup.dp)
    return max(0, (plain.instance.memory_bytes - save.per_host) // ranks)


__all__ = [
    "INSTANCES", "HostBudget", "HostMoment", "Instance", "host_budget", "largest_full_weight", "offload_room",
]  # fmt: skip
