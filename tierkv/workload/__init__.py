"""Serving workloads: what ``tierkv replay``, ``tierkv sim`` and ``tierkv plan`` run.

:mod:`tierkv.workload.trace` holds :class:`Request` and the Mooncake JSONL reader;
:mod:`tierkv.workload.synthetic` the built-in mix (conversations, documents, agents);
:mod:`tierkv.workload.params` the planner's few-parameter workloads; and
:mod:`tierkv.workload.replay` drives a workload through a real store. The names below
are re-exported from the first two, which import only numpy.
"""

from __future__ import annotations

from tierkv.workload.synthetic import SyntheticMix, load_requests, parse_mix, synthetic
from tierkv.workload.trace import MOONCAKE_BLOCK_TOKENS, Request, block_tokens, read_mooncake, request_tokens

__all__ = ["MOONCAKE_BLOCK_TOKENS", "Request", "SyntheticMix", "block_tokens", "load_requests", "parse_mix",
           "read_mooncake", "request_tokens", "synthetic"]
