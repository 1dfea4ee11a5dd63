"""Activation offload: what chosen modules keep for backward goes to host memory in forward and
comes back in backward, copied on side streams beside the compute.

Asked for in the recompute vocabulary (Megatron's ``offload_modules``) and applied by the same
entry point::

    apply_recompute(model, RecomputeConfig("selective", modules=["core_attn"], offload_modules=["mlp"]))

* :mod:`.copies`: the copies between device and host and their ordering edges (streams on an
  accelerator, at once on CPU);
* :mod:`.engine`: a saved tensor becomes a handle to a host copy of its storage, reloaded once
  for every view of it;
* :mod:`.hooks`: the saved-tensor hooks around each offloaded unit, and each layer's prefetch;
* :mod:`.install`: which units a config offloads, and the hooks on the model.

See docs/offload.md.
"""

from .copies import Copies, StreamCopies, SyncCopies
from .engine import OffloadStats
from .install import copies_override, offload_stats

__all__ = ["Copies", "OffloadStats", "StreamCopies", "SyncCopies", "copies_override", "offload_stats"]
