"""Optimizers: ZeRO-1 (optimizer state and fp32 master weights sharded over data parallel)."""

from .zero1 import Zero1Optimizer

__all__ = ["Zero1Optimizer"]
