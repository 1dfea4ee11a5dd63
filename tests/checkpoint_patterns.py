"""The calls users of ``torch.utils.checkpoint`` and Megatron's ``tensor_parallel.checkpoint``
make, as patterns any checkpoint variant can be run through (tests/test_checkpoint_patterns.py,
tests_xla/test_recompute_xla.py).

A pattern builds its inputs, runs a forward that calls ``ckpt(function, *args, **kwargs)`` where a
user would call a checkpoint, and a backward; it returns every number a user would look at (the
outputs and all gradients). :func:`run` gives those numbers for one checkpoint function, so a
variant is checked against the un-checkpointed run (``ckpt = plain``) of the same pattern.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from neuron_ckpt.distributed.random import get_rng_tracker

Ckpt = Callable[..., Any]


def plain(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """No checkpoint: the reference every variant must equal."""
    return function(*args, **kwargs)


@dataclass
class Inputs:
    x: torch.Tensor  # [4, 8], requires grad
    y: torch.Tensor  # [4, 8], requires grad
    w: torch.Tensor  # [8, 8], a "parameter" the functions close over


def make_inputs(device: torch.device | str, grad: bool = True) -> Inputs:
    g = torch.Generator().manual_seed(0)
    x, y, w = (torch.randn(*shape, generator=g) for shape in ((4, 8), (4, 8), (8, 8)))
    return Inputs(*(t.to(device).requires_grad_(grad or t is w) for t in (x, y, w)))


def _layer(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda a: torch.tanh(a @ w) * 1.5


def _loss(out: Any) -> torch.Tensor:
    return sum(
        t.float().pow(2).sum()
        for t in torch.utils._pytree.tree_leaves(out)
        if torch.is_tensor(t) and t.is_floating_point()
    )


# Each forward: (ckpt, inputs) -> outputs. Each takes the "layer" through a checkpoint.


def _single(ckpt: Ckpt, i: Inputs) -> Any:
    return ckpt(_layer(i.w), i.x)


def _nested(depth: int) -> Callable[[Ckpt, Inputs], Any]:
    def forward(ckpt: Ckpt, i: Inputs) -> Any:
        def level(a: torch.Tensor, n: int) -> torch.Tensor:
            inner = _layer(i.w)(a)
            return inner if n == 1 else ckpt(level, inner, n - 1) + a

        return ckpt(level, i.x, depth)

    return forward


def _none_args(ckpt: Ckpt, i: Inputs) -> Any:
    def fn(first, a, middle, b, last):
        assert first is None and middle is None and last is None
        return _layer(i.w)(a) * b

    return ckpt(fn, None, i.x, None, i.y, None)


def _scalar_args(ckpt: Ckpt, i: Inputs) -> Any:
    def fn(scale, a, shift, flag, *, power=2, eps=1e-6):
        return (_layer(i.w)(a) * scale + shift).pow(power) + eps if flag else a

    return ckpt(fn, 0.5, i.x, 3, True, power=3, eps=0.25)


def _tuple_args(ckpt: Ckpt, i: Inputs) -> Any:
    def fn(pair, a, trio):
        (p, q), (r, name, s) = pair, trio
        assert name == "trio" and s is None
        return _layer(i.w)(p + a) * q + r

    return ckpt(fn, (i.x, i.y), i.x * 2, (i.y, "trio", None))


def _kwargs(ckpt: Ckpt, i: Inputs) -> Any:
    def fn(a, *, other, mask=None, scale=1.0, tag="x"):
        assert mask is None and tag == "k"
        return _layer(i.w)(a) * other * scale

    return ckpt(fn, i.x, other=i.y, scale=2.0, tag="k", mask=None)


def _tuple_outputs(ckpt: Ckpt, i: Inputs) -> Any:
    return ckpt(lambda a, b: (_layer(i.w)(a), torch.sigmoid(b) * a), i.x, i.y)


def _non_tensor_outputs(ckpt: Ckpt, i: Inputs) -> Any:
    out = ckpt(lambda a: (_layer(i.w)(a), "name", 3, None, [a.sum(), {"n": 2.5}]), i.x)
    assert out[1:4] == ("name", 3, None) and out[4][1] == {"n": 2.5}
    return out


def _outputs_without_grad(ckpt: Ckpt, i: Inputs) -> Any:
    def fn(a):
        h = _layer(i.w)(a)
        return h, h.detach() * 2, h.argmax(-1)

    return ckpt(fn, i.x)


def _dropout(ckpt: Ckpt, i: Inputs, device: str, stream: str | None) -> Any:
    def fn(a):
        h = _layer(i.w)(a).to(device)
        if stream is None:
            return F.dropout(h, 0.5, training=True)
        with get_rng_tracker().fork(stream):
            return F.dropout(h, 0.5, training=True)

    return ckpt(fn, i.x)


def _nested_streams(ckpt: Ckpt, i: Inputs) -> Any:
    def fn(a):
        tracker = get_rng_tracker()
        h = _layer(i.w)(a)
        with tracker.fork("s1"):
            h = F.dropout(h, 0.5, training=True)
            with tracker.fork("s2"):
                h = F.dropout(h, 0.3, training=True)
                with tracker.fork("s1"):
                    h = F.dropout(h, 0.2, training=True)
            h = F.dropout(h, 0.1, training=True)
        return F.dropout(h, 0.4, training=True)

    return ckpt(fn, i.x)


def _inside_a_fork(ckpt: Ckpt, i: Inputs) -> Any:
    # The checkpoint starts inside an open fork of s1 and its function forks s1 again: the
    # recompute, run outside every fork, must still draw what the forward drew.
    def fn(a):
        h = F.dropout(_layer(i.w)(a), 0.5, training=True)  # the live s1 stream
        with get_rng_tracker().fork("s1"):
            h = F.dropout(h, 0.3, training=True)
        with get_rng_tracker().fork("s2"):
            return F.dropout(h, 0.2, training=True)

    with get_rng_tracker().fork("s1"):
        return ckpt(fn, i.x)


# Backwards: (outputs, inputs) -> the gradients a user reads.


def _grads(i: Inputs) -> list[torch.Tensor | None]:
    return [None if t.grad is None else t.grad.clone() for t in (i.x, i.y, i.w)]


def backward_once(out: Any, i: Inputs) -> list:
    _loss(out).backward()
    return _grads(i)


def backward_twice(out: Any, i: Inputs) -> list:
    loss = _loss(out)
    loss.backward(retain_graph=True)
    first = _grads(i)
    loss.backward()
    return first + _grads(i)


def double_backward(out: Any, i: Inputs) -> list:
    leaves = [t for t in (i.x, i.y, i.w) if t.requires_grad]
    grads = torch.autograd.grad(_loss(out), leaves, create_graph=True, allow_unused=True)
    sum(g.pow(2).sum() for g in grads if g is not None).backward()
    return [g.detach() for g in grads if g is not None] + _grads(i)


@dataclass(frozen=True)
class Pattern:
    forward: Callable[[Ckpt, Inputs], Any]
    backward: Callable[[Any, Inputs], list] = backward_once
    grad_inputs: bool = True  # False: x and y need no grad, only the closed-over w does
    device_dropout: bool = False  # draws from the device generator: needs a device


PATTERNS: dict[str, Pattern] = {
    "backward": Pattern(_single),
    "backward_twice_retain_graph": Pattern(_single, backward_twice),
    "double_backward": Pattern(_single, double_backward),
    "nested_2": Pattern(_nested(2)),
    "nested_3": Pattern(_nested(3)),
    "nested_2_double_backward": Pattern(_nested(2), double_backward),
    "none_args": Pattern(_none_args),
    "scalar_args": Pattern(_scalar_args),
    "tuple_args": Pattern(_tuple_args),
    "kwargs": Pattern(_kwargs),
    "tuple_outputs": Pattern(_tuple_outputs),
    "non_tensor_outputs": Pattern(_non_tensor_outputs),
    "outputs_without_grad": Pattern(_outputs_without_grad),
    "inputs_without_grad": Pattern(_single, grad_inputs=False),
    "dropout_cpu_generator": Pattern(lambda c, i: _dropout(c, i, "cpu", None)),
    "dropout_device_generator": Pattern(lambda c, i: _dropout(c, i, "device", None), device_dropout=True),
    "dropout_tracker_stream": Pattern(lambda c, i: _dropout(c, i, "cpu", "s1")),
    "dropout_nested_streams": Pattern(_nested_streams),
    "dropout_checkpoint_inside_a_fork": Pattern(_inside_a_fork),
    "dropout_twice_retain_graph": Pattern(lambda c, i: _dropout(c, i, "cpu", "s2"), backward_twice),
}


def seed_streams(device: torch.device | str) -> None:
    """The same generator and stream states before every run (two tracker streams)."""
    tracker = get_rng_tracker()
    tracker.reset()
    torch.manual_seed(1234)  # the CPU generator and every accelerator's
    if torch.device(device).type == "xla":
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(1234)
    tracker.add("s1", 11)
    tracker.add("s2", 12)


def run(
    name: str,
    ckpt: Ckpt,
    device: torch.device | str = "cpu",
    wrap: Callable[[Callable], Callable] = lambda f: f,
) -> list[torch.Tensor | None]:
    """Pattern ``name`` through ``ckpt`` on ``device``: outputs, then gradients, on the CPU.

    ``device``: where the inputs live; the device dropout runs there (``"cpu"`` tensors never
    touch a device generator). ``wrap``: applied to the forward (``torch.compile``)."""
    pattern = PATTERNS[name]
    forward = pattern.forward
    if pattern.device_dropout:
        forward = lambda c, i, _f=forward: _dropout(c, i, str(device), None)  # noqa: E731
    seed_streams(device)
    inputs = make_inputs(device, pattern.grad_inputs)
    out = wrap(lambda i: forward(ckpt, i))(inputs)
    flags = [t.requires_grad for t in torch.utils._pytree.tree_leaves(out) if torch.is_tensor(t)]
    values = [t.detach() for t in torch.utils._pytree.tree_leaves(out) if torch.is_tensor(t)]
    grads = pattern.backward(out, inputs)
    return [torch.tensor(flags)] + [None if t is None else t.cpu() for t in values + grads]


def differences(ref: list, got: list, outputs_grad_flags: bool = True, grad_rtol: float = 0.0) -> list[str]:
    """Where ``got`` differs from ``ref``; empty when equal. The first entry is the outputs'
    requires_grad flags, compared when ``outputs_grad_flags``. Tensors must be bit-identical,
    or with ``grad_rtol`` within ``grad_rtol`` times the reference's largest magnitude."""
    if len(ref) != len(got):
        return [f"{len(got)} results, the reference has {len(ref)}"]
    found = []
    for k, (a, b) in enumerate(zip(ref, got)):
        if k == 0:
            if outputs_grad_flags and not torch.equal(a, b):
                found.append(f"outputs' requires_grad: {b.tolist()}, the reference's {a.tolist()}")
        elif (a is None) != (b is None) or (a is not None and a.shape != b.shape):
            found.append(f"result {k}: {b!r} where the reference has {a!r}")
        elif a is not None and not torch.equal(a, b):
            error = float((a.double() - b.double()).abs().max())
            if error > grad_rtol * float(a.double().abs().max()):
                found.append(f"result {k} differs by {error:.3g}")
    return found


def outcome(fn: Callable[..., Any], *args: Any) -> tuple[str, Any]:
    """("ran", ``fn(*args)``) or ("error", its one-line message); the tracker is reset after."""
    try:
        return "ran", fn(*args)
    except Exception as e:  # noqa: BLE001  any error is the verdict, checked by the caller
        return "error", one_line(e)
    finally:
        get_rng_tracker().reset()


def one_line(error: BaseException) -> str:
    """``Type: message``, the whole message (a test checks it is one line)."""
    return f"{type(error).__name__}: {error}"


def matches(error_line: str, pattern: str) -> bool:
    return re.search(pattern, error_line) is not None
