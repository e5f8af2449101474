"""Layer-wise loads: store pages into an engine's KV one layer at a time, one completion each.

An engine that calls :func:`load_layers` before a forward pass can start attention on
layer ``i`` (``load.wait_layer(i)`` makes its compute stream wait, without blocking
the host) while layers ``i+1..`` are still being copied on the copy stream. On the
kernel path the descriptors of every layer are built and uploaded once and each
layer is one launch; on the torch path each layer is one index copy (host pages with
a CUDA engine are first staged whole, so layer 0 waits for every page: a degraded
but correct pipeline). On CPU every layer is done before ``load_layers`` returns.
Called by serving-engine connectors.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from tierkv.engine.kv import EngineKV
from tierkv.engine.rows import Indices
from tierkv.engine.streams import Completion, CopyStream
from tierkv.errors import InputError


@dataclass(frozen=True)
class LayerwiseLoad:
    """The completions of one layer-wise load, layer 0 first."""

    layers: tuple[Completion, ...]

    def layer(self, i: int) -> Future[None]:
        """Done once layer ``i`` (and every layer before it) is in the engine's KV."""
        return self.layers[i].future

    def wait_layer(self, i: int, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: current) wait for layer ``i``; the host does not block."""
        self.layers[i].wait_on(stream)

    def result(self, timeout: float | None = None) -> None:
        """Wait for every layer (``timeout`` in seconds for the whole load); re-raises a failure."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for c in self.layers:
            c.future.result(None if deadline is None else max(0.0, deadline - time.monotonic()))


def load_layers(kv: EngineKV, pages: torch.Tensor, block_ids: Indices, copier: CopyStream,
                rows: Indices | None = None) -> LayerwiseLoad:
    """Scatter ``pages`` rows (``rows``, default all) into ``block_ids`` layer by layer on ``copier``.

    ``pages`` is a page buffer on the engine's device (HBM tier slots) or on the host
    (pinned DRAM tier slots for the in-place kernel path). Arguments are checked before
    anything is enqueued (InputError); a copy that fails completes its layer's future,
    and every later one, with TierIOError.
    """
    if copier.device != kv.device:
        raise InputError(f"the copy stream is on {copier.device} but the engine KV on {kv.device}")
    copies = kv.layer_copies(pages, block_ids, rows)
    return LayerwiseLoad(tuple(copier.submit_each(copies, keep=(pages, kv))))
