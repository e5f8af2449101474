"""Pages handed between nodes: a store serves its DRAM tier to peers, and loads from peers
the pages it does not hold.

:class:`Peering` is built by :class:`tierkv.store.api.Store` from ``[peers]``. Serving: a
:class:`~tierkv.net.PeerServer` over the store's own DRAM tier, read-only to remote
nodes, whose key index follows the block manager's events (a page is announced after its
bytes are published in DRAM, withdrawn before its slot is reused, so a remote read that
races a reuse fails its checksum: a miss). Fetching: for the pages that follow the ones
a ``get`` found here, each peer in ``fetch`` is asked in turn (a key lookup RPC, then the
pages by their remote slots, each checked against the peer's checksum); a peer that
cannot be reached is skipped until its next reconnect attempt. Keys are the store's own
(model, layout and tenant salted), so nodes of one model share pages and tenants never do.
Called by the API with the store lock held.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np

from tierkv.config import PeersConfig
from tierkv.errors import TierKVError
from tierkv.keys import PageKey
from tierkv.store.manager import BlockManager
from tierkv.net import NetConfig, PeerServer, connect
from tierkv.tiers.base import TierId
from tierkv.tiers.dram import DramTier
from tierkv.tiers.peer import PeerDramTier

log = logging.getLogger(__name__)
RETRY_S = 5.0  # a peer that could not be reached is tried again after this long


class Peering:
    """This store's peer server (if it serves) and its clients (if it fetches)."""

    def __init__(self, cfg: PeersConfig, manager: BlockManager, page_bytes: int) -> None:
        self.cfg = cfg
        self._net = NetConfig(timeout_s=cfg.timeout_s, connect_timeout_s=cfg.timeout_s)
        self._page_bytes = page_bytes
        self._generation = time.time_ns()
        self.server: PeerServer | None = None
        self._served: TierId | None = None  # the DRAM tier the server serves
        endpoint = cfg.serve_endpoint()
        if endpoint is not None:
            dram = next((t for t in manager.tiers if isinstance(t, DramTier)), None)
            if dram is None:
                raise TierKVError("[peers] serve needs a DRAM tier to serve; this store has none")
            self.server = PeerServer(dram, endpoint[0], endpoint[1], self._net, rdma=cfg.transport == "rdma",
                                     accept_writes=False)
            self._served = dram.name
            manager.listeners.append(self._on_event)
        self._peers: dict[tuple[str, int], PeerDramTier | None] = {ep: None for ep in cfg.fetch_endpoints()}
        self._next_try: dict[tuple[str, int], float] = {}

    @property
    def address(self) -> tuple[str, int] | None:
        return self.server.address if self.server is not None else None

    # -- serving -----------------------------------------------------------------------
    def _on_event(self, event: str, tier: TierId, keys: list[PageKey], slots: list[int]) -> None:
        if self.server is None or tier != self._served:
            return
        if event == "placed":
            self._generation += 1
            self.server.store.seal(keys, slots, self._generation, self._page_bytes)
        else:
            self.server.store.unseal(keys, slots)

    # -- fetching ----------------------------------------------------------------------
    def fetch(self, keys: Sequence[PageKey], rows: np.ndarray) -> int:
        """Load the leading ``keys`` that some peer holds into ``rows``; returns how many.

        Stops at the first page no reachable peer returns intact. Never raises for a peer's
        failure: an unreachable or slow peer is a miss within ``timeout_s``.
        """
        got = 0
        for ep in self._peers:
            if got == len(keys):
                break
            tier = self._client(ep)
            if tier is None:
                continue
            try:
                metas = tier.lookup(list(keys[got:]))
                lead = next((i for i, m in enumerate(metas) if m is None), len(metas))
                if lead == 0:
                    continue
                res = tier.fetch_remote([m for m in metas[:lead] if m is not None], rows[got:got + lead])
            except TierKVError as exc:
                log.warning("peer %s:%d failed (%s); its pages are misses for now", ep[0], ep[1], exc)
                self._drop(ep)
                continue
            n = next((i for i, ok in enumerate(res.ok) if not ok), len(res.ok))
            got += n
        return got

    def _client(self, ep: tuple[str, int]) -> PeerDramTier | None:
        tier = self._peers[ep]
        if tier is not None or time.monotonic() < self._next_try.get(ep, 0.0):
            return tier
        try:
            tier = PeerDramTier(connect(ep[0], ep[1], self.cfg.transport, self._net))  # type: ignore[arg-type]
        except TierKVError as exc:
            log.warning("peer %s:%d unreachable (%s); retrying in %.0f s", ep[0], ep[1], exc, RETRY_S)
            self._next_try[ep] = time.monotonic() + RETRY_S
            return None
        self._peers[ep] = tier
        return tier

    def _drop(self, ep: tuple[str, int]) -> None:
        tier, self._peers[ep] = self._peers[ep], None
        self._next_try[ep] = time.monotonic() + RETRY_S
        if tier is not None:
            tier.close()

    def close(self) -> None:
        for ep in list(self._peers):
            tier, self._peers[ep] = self._peers[ep], None
            if tier is not None:
                tier.close()
        if self.server is not None:
            self.server.close()
