"""DualPath: load a prefill's cached KV through the decode side's idle storage NICs too.

In prefill/decode-disaggregated serving every load of cached KV flows storage -> prefill
engine, so the prefill side's storage NICs saturate while the decode side's idle (Wu et
al., "DualPath: Breaking the Storage Bandwidth Bottleneck in Agentic LLM Inference",
arXiv 2602.21548). DualPath adds a second path, storage -> decode engine -> prefill engine
over the (faster) compute network, and picks the side per request.

- :mod:`~tierkv.dualpath.scheduler`: which side reads what (:func:`choose_reads`): the
  paper's per-request choice by the shorter read queue, and ours, a split of one
  request's pages between the two sides so both finish together; never a node that lacks
  the pages.
- :mod:`~tierkv.dualpath.push`: the second path in the store: a helper node reads pages
  for another and pushes them into its landing zone (``[peers] helper``, ``landing``).
- :mod:`~tierkv.dualpath.loads`: the requesting node divides each fetch from storage
  peers between its own reads and a helper's push, by the scheduler, from each side's
  measured cost (``[peers] helpers``, ``dualpath``).
- :mod:`~tierkv.dualpath.sim`: a seeded discrete-event simulator of P prefill and D
  decode engines under a multi-turn agent workload (``tierkv sim dualpath``,
  docs/dualpath.md).
"""
