"""Which of transformers' experts implementations runs on XLA, checked when recompute is applied.

transformers 5 runs a mixture-of-experts block's experts through the function its config names
(``config._experts_implementation``, set with ``model.set_experts_implementation``) and picks
``grouped_mm`` on any device it does not special-case, XLA among them. On torch-xla 2.9 (the
Neuron SDK 2.28 pairing; seen on XLA:CPU) grouped_mm cannot run: it counts the tokens of each
expert with an int32 ``torch.histc``, which torch-xla hands to the CPU kernel, which has no
integer version (``NotImplementedError: "histogram_cpu" not implemented for 'Int'``), and past
that ``torch._grouped_mm`` on XLA tensors kills the process (segmentation fault). ``batched_mm``
(every token through each of its k experts' weights, gathered: static shapes) lowers and runs;
``eager`` (a loop over the experts a batch hit, data-dependent shapes) runs but traces a new
graph for each routing. So a model on XLA set to grouped_mm is refused in one line, before
anything changes, naming the fix.
"""

from __future__ import annotations

import torch

from .module import unwrapped
from .moe import is_moe_block


def check_experts_implementation(model: torch.nn.Module) -> None:
    """Raise a one-line ValueError if ``model`` has parameters on an XLA device and the experts
    of one of its MoE blocks run transformers' ``grouped_mm``."""
    if not any(p.device.type == "xla" for p in model.parameters()):
        return
    for name, block in model.named_modules():
        if not is_moe_block(block):
            continue
        experts = unwrapped(unwrapped(block)._modules["experts"])  # type: ignore[arg-type]  # _modules maps names to Module | None; this one is set
        if getattr(getattr(experts, "config", None), "_experts_implementation", None) == "grouped_mm":
            raise ValueError(
                f"{name}.experts ({type(experts).__name__}) runs transformers' experts implementation "
                "'grouped_mm', which does not run on XLA (an int32 torch.histc torch-xla has no kernel for, "
                "then torch._grouped_mm crashes); call model.set_experts_implementation('batched_mm') first"
            )
