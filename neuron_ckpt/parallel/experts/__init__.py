"""Expert parallelism: a layer's experts spread over the EP group, tokens sent to them and back.

Under expert parallelism (``initialize_model_parallel(expert_model_parallel_size=e)``) EP rank
``j`` holds experts ``[j E/e, (j+1) E/e)`` whole (expert tensor parallel size 1: see
:mod:`neuron_ckpt.distributed.layout`). Each rank routes its own tokens; a *dispatch* brings every
(token, chosen expert) pair, a *route*, to the rank holding that expert, the experts run there on
what they received, and a *combine* brings the outputs back and adds them up weighted by the
routing scores. Two forms, the same result:

* :mod:`.all_to_all` (eager backends, the default there): dropless. The routes sorted by expert
  travel by ``all_to_all_single`` with uneven splits (the per-expert counts are exchanged first, one
  host sync per layer), every route computed once; the outputs come back the same way and the
  sender multiplies them by its routing weights, so the router's gradient never leaves its rank.
* :mod:`.all_gather` (XLA, where shapes must be static and trn1 has no all-to-all): every rank
  all-gathers the EP group's tokens and routing, keeps up to ``capacity`` routes per local expert
  in a fixed-size buffer, runs its experts on that buffer and reduce-scatters the weighted outputs
  back. Routes over capacity are dropped and counted (:attr:`~.all_gather.Trip.dropped`); with
  ``capacity_factor=None`` the capacity is every gathered token and nothing is dropped.

:class:`ExpertDispatch` picks the form; the transformers binding (experts planned
``ep_dispatch_experts``) is :mod:`neuron_ckpt.parallel.hf.expert_parallel`.
"""

from .dispatch import ExpertDispatch, Routed

__all__ = ["ExpertDispatch", "Routed"]
