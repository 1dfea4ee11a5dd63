"""``nc.destroy_distributed()`` releases every process group, and recompute makes no reference cycle.

With torch 2.13's gloo, a process group that outlives ``destroy_process_group()`` aborts the
interpreter at exit about one run in five ("terminate called without an active exception").
A user's script keeps its ``state`` (README), and before the fix the recompute wrappers tied each
wrapped module into a cycle with its wrapper, so the layers, their ``ParallelState`` and the
process groups lived on until interpreter exit. Here:

* a 2-rank script (a tiny Llama with selective recompute, forward + backward, ending with
  ``nc.destroy_distributed()``) is launched 8 times as two plain processes and every rank must
  exit 0 and find, by weak reference, that no process group outlived ``destroy_distributed()``
  (that check is deterministic; the abort it prevents came about one launch in five, so 8 clean
  exits would pass by chance 17% without it);
* in this process: after ``destroy_distributed()`` no ``ParallelState``, ``Runtime`` or process
  group is reachable from the package's modules, even with ``state`` and a model still held;
* a model with recompute applied is freed on ``del`` with the cycle collector off.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import time
import weakref

import pytest
import torch
import torch.distributed as dist

import neuron_ckpt as nc
from neuron_ckpt.distributed import runtime
from neuron_ckpt.distributed.parallel_state import Group, ParallelState
from neuron_ckpt.distributed.random import get_rng_tracker
from neuron_ckpt.models.llama import LlamaForCausalLM
from neuron_ckpt.models.llama_args import LlamaArgs
from neuron_ckpt.recompute import Recompute, RecomputeConfig, apply_recompute, run_layers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = 8
PARALLEL = 2  # launches at a time (two processes each): the suite shares 2 cores
SELECTIVE = RecomputeConfig(granularity="selective", modules=["core_attn", "mlp_act", "norm"])


def tiny_llama(layers: int = 2, recompute: RecomputeConfig | None = None) -> LlamaForCausalLM:
    """A tiny Llama (LlamaArgs: no transformers import), with ``recompute`` applied."""
    args = LlamaArgs(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        max_position_embeddings=32,
    )
    model = LlamaForCausalLM(args)
    if recompute is not None:
        apply_recompute(model, recompute)
    return model


# --------------------------------------------------------------------------------------------
# A user's script, 8 launches.

SCRIPT = textwrap.dedent(
    """
    import weakref

    import torch
    import neuron_ckpt as nc
    from neuron_ckpt.models import LlamaArgs, LlamaForCausalLM
    from neuron_ckpt.recompute import RecomputeConfig, apply_recompute

    torch.set_num_threads(1)
    nc.init_distributed()
    state = nc.initialize_model_parallel(tensor_parallel_size=2)   # kept to the end, as in the README
    nc.model_parallel_manual_seed(1234)
    args = LlamaArgs(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                     num_attention_heads=2, max_position_embeddings=32, attention_dropout=0.1)
    model = LlamaForCausalLM(args, sequence_parallel=True)
    apply_recompute(model, RecomputeConfig(granularity="selective", modules=["core_attn", "mlp_act", "norm"]))
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()
    groups = [weakref.ref(g.process_group) for g in (state.tp, state.dp)]   # TP: WORLD; DP: new_group
    del model
    nc.destroy_distributed()
    assert all(g() is None for g in groups), "a process group outlived destroy_distributed()"
    assert state.tp.released and state.dp.released
    """
)


def _env(rank: int, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PJRT_DEVICE")}
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE="2",
        OMP_NUM_THREADS="1",
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    return env


def _launch(script: str, log_dir: str, run: int) -> list[tuple[subprocess.Popen, str]]:
    """One 2-rank world: two plain processes with the env:// variables torchrun would set."""
    port, procs = runtime.free_port(), []
    for rank in (0, 1):
        log = os.path.join(log_dir, f"run{run}_rank{rank}.log")
        with open(log, "wb") as out:
            procs.append(
                (
                    subprocess.Popen(
                        [sys.executable, script], env=_env(rank, port), stdout=out, stderr=subprocess.STDOUT
                    ),
                    log,
                )
            )
    return procs


def test_script_ending_with_destroy_distributed_exits_cleanly_every_time(tmp_path):
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    pending, running, failures = list(range(RUNS)), {}, []
    started = time.monotonic()
    while pending or running:
        while pending and len(running) < PARALLEL:
            run = pending.pop(0)
            running[run] = (_launch(str(script), str(tmp_path), run), time.monotonic())
        time.sleep(0.05)
        for run, (procs, t0) in list(running.items()):
            if time.monotonic() - t0 > 120:  # a hang is a failure too, not a stuck suite
                for p, _ in procs:
                    p.kill()
            if all(p.poll() is not None for p, _ in procs):
                del running[run]
                for rank, (p, log) in enumerate(procs):
                    if p.returncode != 0:
                        with open(log) as f:
                            failures.append(f"run {run} rank {rank}: exit {p.returncode}\n{f.read()[-2000:]}")
    elapsed = time.monotonic() - started
    assert not failures, f"{len(failures)} of {2 * RUNS} ranks failed in {elapsed:.0f} s:\n" + "\n".join(failures)


# --------------------------------------------------------------------------------------------
# In this process (world size 1).


def _ours(name: str) -> bool:
    return name == "neuron_ckpt" or name.startswith("neuron_ckpt.")


def _reachable_from_package(kinds: tuple[type, ...]) -> list[object]:
    """Instances of ``kinds`` reachable through strong references from neuron_ckpt's modules,
    without walking into other packages' modules (torch's own state is checked by weakrefs)."""
    modules = [m for n, m in list(sys.modules.items()) if m is not None and _ours(n)]
    foreign = {id(m) for n, m in list(sys.modules.items()) if m is not None and not _ours(n)}
    foreign |= {id(vars(m)) for n, m in list(sys.modules.items()) if m is not None and not _ours(n)}
    seen, found, stack = set(), [], list(modules)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or id(obj) in foreign:
            continue
        seen.add(id(obj))
        if isinstance(obj, kinds):
            found.append(obj)
        stack.extend(gc.get_referents(obj))
    return found


def _train_step(model: torch.nn.Module) -> None:
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()


@pytest.fixture
def single():
    """torch.distributed in this process (world size 1), torn down however the test ends."""
    yield
    nc.destroy_distributed()
    get_rng_tracker().reset()


def test_destroy_distributed_leaves_no_group_reachable(single):
    rt = nc.init_distributed(backend="gloo")
    # When the default group is not gloo (XLA, nccl) the runtime also holds a gloo host_group: stand one in.
    object.__setattr__(rt, "host_group", dist.new_group(backend="gloo"))
    host = weakref.ref(rt.host_group)
    state = nc.initialize_model_parallel(1)
    nc.model_parallel_manual_seed(0)
    model = tiny_llama(recompute=SELECTIVE)
    _train_step(model)
    world = weakref.ref(dist.group.WORLD)
    assert state.tp.process_group is world() and state.dp.process_group is world()
    # The walk does see the state and the groups while they are set.
    assert {type(o) for o in _reachable_from_package((ParallelState, dist.ProcessGroup))} == {
        ParallelState,
        type(world()),
    }

    kept = tiny_llama(1, SELECTIVE)  # a model the user still holds
    del model
    nc.destroy_distributed()

    assert world() is None, "the WORLD process group outlived destroy_distributed()"
    assert host() is None, "the runtime's host_group outlived destroy_distributed()"
    assert _reachable_from_package((ParallelState, dist.ProcessGroup, runtime.Runtime)) == []
    assert not any(isinstance(o, Group) and not o.released for o in _reachable_from_package((Group,)))
    # What the caller kept lets go of its groups, and says so if used.
    assert state.tp.released and kept.parallel_state.dp.released and rt.host_group is None
    with pytest.raises(RuntimeError, match="not initialised"):
        runtime.get_runtime()  # forgotten (and reachable from no module: checked above)
    with pytest.raises(RuntimeError, match="released by neuron_ckpt.destroy_distributed"):
        _ = state.tp.process_group  # the property raises
    assert not dist.is_initialized()

    # A new world works after the teardown.
    state2 = nc.initialize_model_parallel(1)
    assert not state2.tp.released and state2.tp.process_group is dist.group.WORLD


def test_groups_without_a_process_group_are_untouched(single):
    one = Group(process_group=None, ranks=(0,), replica_groups=((0,),), rank=0)
    nc.init_distributed(backend="gloo")
    nc.destroy_distributed()
    assert not one.released and one.process_group is None and one.size == 1
    assert one == Group(None, (0,), ((0,),), 0)
    with pytest.raises(AttributeError):
        one.rank = 1


class Block(torch.nn.Module):
    """A user's block built from our layers (module level, so it pickles)."""

    def __init__(self, state: ParallelState | None = None):
        from neuron_ckpt.parallel import ColumnParallelLinear, RMSNorm, RowParallelLinear

        super().__init__()
        self.norm = RMSNorm(8)
        self.up = ColumnParallelLinear(8, 16, bias=False, parallel_state=state)
        self.act_fn = torch.nn.GELU()
        self.down = RowParallelLinear(16, 8, bias=False, parallel_state=state)

    def forward(self, x):
        return x + self.down(self.act_fn(self.up(self.norm(x))))


class Stack(torch.nn.Module):
    def __init__(self, layers: int, state: ParallelState | None = None):
        super().__init__()
        self.layers = torch.nn.ModuleList(Block(state) for _ in range(layers))

    def forward(self, x):
        return run_layers(self.layers, x)


@pytest.mark.parametrize(
    "config",
    [
        SELECTIVE,
        RecomputeConfig(granularity="full", method="uniform", num_layers=2),  # grouped: a _Group
        RecomputeConfig(granularity="full", method="block", num_layers=1),
        [
            None,
            RecomputeConfig(granularity="full", method="uniform", num_layers=1),
            RecomputeConfig(granularity="selective", modules=["mlp_act", "norm"]),
            None,
        ],
    ],
    ids=["selective", "uniform2", "block1", "per_layer"],
)
def test_recomputed_model_is_freed_without_the_cycle_collector(single, config):
    nc.initialize_model_parallel(1)
    nc.model_parallel_manual_seed(0)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        if isinstance(config, list) or config.granularity == "full":
            model = Stack(4)
            apply_recompute(model.layers, config)
            x = torch.randn(4, 2, 8, requires_grad=True)
            model(x).sum().backward()
        else:
            model = tiny_llama(recompute=config)
            _train_step(model)
        refs = {name: weakref.ref(m) for name, m in model.named_modules()}  # every wrapped module too
        del model
        alive = [name for name, ref in refs.items() if ref() is not None]
        assert not alive, f"not freed on del (a reference cycle): {alive}"
    finally:
        if was_enabled:
            gc.enable()


def test_backward_after_the_model_is_dropped_still_recomputes(single):
    """The checkpoint keeps the module it recomputes (strongly, through the graph only)."""
    nc.initialize_model_parallel(1)
    for config in (SELECTIVE, RecomputeConfig(granularity="full", method="uniform", num_layers=2)):
        torch.manual_seed(0)
        model = Stack(4) if config.granularity == "full" else tiny_llama(recompute=config)
        params = list(model.parameters())
        if config.granularity == "full":
            apply_recompute(model.layers, config)
            loss = model(torch.randn(4, 2, 8, requires_grad=True)).sum()
        else:
            ids = torch.randint(0, 32, (2, 8))
            loss = model(ids, labels=ids).loss
        refs = [weakref.ref(m) for m in model.modules()]
        del model
        loss.backward()
        assert all(p.grad is not None for p in params)
        del loss
        assert all(ref() is None for ref in refs)  # the graph was the last holder


@pytest.mark.parametrize(
    "config",
    [
        RecomputeConfig(granularity="selective", modules=["mlp_act", "norm"]),
        RecomputeConfig(granularity="full", method="uniform", num_layers=2),
    ],
    ids=["selective", "uniform2"],
)
def test_a_copied_model_recomputes_itself_and_is_freed(single, config):
    """deepcopy and pickle copy each Recompute with the module it holds (a deep copy shares the
    process groups; pickling needs groups without one)."""
    import copy
    import pickle

    one = Group(None, (0,), ((0,),), 0)
    for make, state in (
        (copy.deepcopy, nc.initialize_model_parallel(1)),
        (lambda m: pickle.loads(pickle.dumps(m)), ParallelState(one, one)),
    ):
        model = Stack(4, state)
        apply_recompute(model.layers, config)
        _check_copy(model, make)


def _check_copy(model: torch.nn.Module, make) -> None:
    clone = make(model)
    assert (
        clone.layers[0].up.parallel_state.tp == model.layers[0].up.parallel_state.tp
    )  # the same group (deepcopy: itself)
    wrapped = [m for m in clone.modules() if isinstance(m, Recompute)]
    params = {id(p) for p in clone.parameters()}
    assert wrapped and all({id(p) for p in m.module.parameters()} <= params for m in wrapped)  # the copy's own
    assert [name for name, _ in clone.named_parameters()] == [name for name, _ in model.named_parameters()]
    group = None
    if isinstance(clone.layers[0], Recompute) and clone.layers[0].span > 1:
        group = [layer.span for layer in clone.layers[:2]]
        assert group == [2, 0]
    clone(torch.randn(4, 2, 8)).sum().backward()  # gradients reach the copy's parameters only
    assert all(p.grad is not None for p in clone.parameters())
    assert all(p.grad is None for p in model.parameters())
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        refs = [weakref.ref(m) for m in clone.modules()]
        del clone, wrapped, group
        assert all(ref() is None for ref in refs)
    finally:
        if was_enabled:
            gc.enable()
