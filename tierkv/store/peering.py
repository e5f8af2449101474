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
Looking up (:meth:`Peering.lookup`, for ``Store.lookup``): the same key lookup RPC, sent
to every peer at once and answered within ``LOOKUP_TIMEOUT_S`` or taken for a miss, so a
lookup sees the pages a get would fetch. ``fetch`` is called by the API with the store
lock held, ``lookup`` without it: the peers' connections are shared under a lock of
their own, and made on a thread of their own, so a lookup never waits for a connect.

Peers authenticate with the secrets ``[peers]`` names (:mod:`tierkv.net.auth`), and the
served store is keyed: a read names each page's key. Where ``tenant_secrets`` lets a
principal see one tenant's pages only, each page this store places in the served tier
is tagged with the tenant of the request that placed it (the API says which, through
:meth:`Peering.placing`); a page placed outside a request of its own (a victim demoted
from a tier above) is tagged unknown, which only the cluster's principal may read.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Protocol

import numpy as np

from tierkv.config import PeersConfig
from tierkv.errors import ConfigError, TierKVError
from tierkv.keys import PageKey, split_keys, tenant_salt
from tierkv.net.auth import CLUSTER, UNKNOWN_TENANT, Credential, ServerAuth, load_secret, tenant_tag
from tierkv.store.manager import BlockManager
from tierkv.dualpath.loads import Loads
from tierkv.dualpath.push import Helper, Landing, Loader
from tierkv.net import NetConfig, PeerServer, connect
from tierkv.net.transport import CallResult
from tierkv.net.wire import MAX_LOOKUP_KEYS, decode_metas, encode_keys
from tierkv.tiers.base import TierId
from tierkv.tiers.dram import DramTier
from tierkv.tiers.peer import PeerDramTier

log = logging.getLogger(__name__)
RETRY_S = 5.0  # a peer that could not be reached is tried again after this long
#: How long a lookup waits for its peers' answers (and for a first connection to them):
#: engines look up on every scheduling step, so a peer slower than this is a miss, and
#: is not asked by lookups again for ``RETRY_S``. Capped by ``[peers] timeout_s``.
LOOKUP_TIMEOUT_S = 0.05
Endpoint = tuple[str, int]
#: The page directory's view, for a chain's keys: the peers holding its leading pages, best
#: first (None: it cannot say).
Route = Callable[[Sequence[PageKey]], "list[Endpoint] | None"]


class Publishing(Protocol):
    """What the page directory's publisher is told (:class:`tierkv.cluster.publisher.Publisher`):
    pages placed, with their positions in their chains where below ``depth_cap`` (else -1),
    and pages removed."""

    depth_cap: int

    def placed(self, keys: Sequence[PageKey], depths: Sequence[int]) -> None: ...

    def removed(self, keys: Sequence[PageKey]) -> None: ...


class Peering:
    """This store's peer server (if it serves) and its clients (if it fetches)."""

    def __init__(self, cfg: PeersConfig, manager: BlockManager, page_bytes: int, loader: Loader | None = None) -> None:
        self.cfg = cfg
        assert cfg.secret_file is not None, "PeersConfig requires it with serve or fetch"
        secret = load_secret(cfg.secret_file, "[peers] secret_file")
        # This node's own principal: the cluster's, or one tenant's (then it fetches only that tenant's pages).
        self._own_tag = None if cfg.tenant is None else tenant_tag(tenant_salt(cfg.tenant))
        credential = Credential(CLUSTER if cfg.tenant is None else "tenant:" + cfg.tenant, secret)
        self._net = NetConfig(timeout_s=cfg.timeout_s, connect_timeout_s=cfg.timeout_s, credential=credential)
        self._page_bytes = page_bytes
        self._generation = time.time_ns()
        self.server: PeerServer | None = None
        self._served: TierId | None = None  # the DRAM tier the server serves
        # Tenant tags are kept only where a principal may see one tenant's pages.
        self._tagging = bool(cfg.tenant_secrets)
        self._request: tuple[bytes, int] | None = None    # the placing request's key blob and tag
        self._request_keys: dict[bytes, int] | None = None   # its keys' positions, made on its first placement
        endpoint = cfg.serve_endpoint()
        if endpoint is not None:
            dram = next((t for t in manager.tiers if isinstance(t, DramTier)), None)
            if dram is None:
                raise TierKVError("[peers] serve needs a DRAM tier to serve; this store has none")
            principals: dict[str, tuple[bytes, int | None]] = {}
            if cfg.tenant is None:  # a tenant's secret is not the cluster's: it is accepted under its name only
                principals[CLUSTER] = (secret, None)
            for name, path in cfg.tenant_secrets.items():
                principals["tenant:" + name] = (load_secret(path, f"[peers] tenant_secrets.{name}"),
                                                tenant_tag(tenant_salt(name)))
            if cfg.tenant is not None:
                principals.setdefault(credential.principal, (secret, self._own_tag))
            if cfg.transport == "rdma" and self._tagging:
                raise ConfigError("[peers] transport = \"rdma\" with tenant_secrets: RDMA reads are one-sided and "
                                  "reach every served slot, so they cannot be limited to one tenant; serve over "
                                  "tcp, or give tenants no secrets of their own")
            self.server = PeerServer(dram, endpoint[0], endpoint[1], self._net, rdma=cfg.transport == "rdma",
                                     accept_writes=False, auth=ServerAuth(principals), keyed=True)
            self._served = dram.name
            manager.listeners.append(self._on_event)
        # DualPath (tierkv.dualpath): reading for other nodes, and having them read for this one.
        self.node_id = int.from_bytes(os.urandom(8), "little") | 1   # tells a helper it was asked by itself
        self._helper: Helper | None = None
        self._loads: Loads | None = None
        try:
            self._set_up_dualpath(cfg, loader, page_bytes, secret)
        except BaseException:
            if self.server is not None:   # Store's cleanup never sees a Peering that failed to be made
                self.server.close()
            raise
        # The peers fetched from, and their connections, shared by fetches (under the store's
        # lock) and lookups (without it) under this lock; connects run on threads of their own.
        self._lock = threading.Lock()
        self._closed = False
        self._peers: dict[Endpoint, PeerDramTier | None] = {ep: None for ep in cfg.fetch_endpoints()}
        self._connecting: dict[Endpoint, Future[PeerDramTier | None]] = {}
        self._next_try: dict[Endpoint, float] = {}
        self._quiet_until: dict[Endpoint, float] = {}   # peers that answered a lookup late
        self._cluster: set[Endpoint] = set()   # peers the cluster named (set_cluster_peers)
        self._channels = itertools.count()
        self._manager = manager
        # The cluster's page directory (set_directory): told what this node serves, and
        # asked which members hold a prompt's pages.
        self._publisher: Publishing | None = None
        self._route: Route | None = None

    def _set_up_dualpath(self, cfg: PeersConfig, loader: Loader | None, page_bytes: int, secret: bytes) -> None:
        # Only "rdma" moves pushes by RDMA, on both sides: a landing server listens on RDMA
        # only then, so a helper must not pick it by itself ("auto").
        kind = "rdma" if cfg.transport == "rdma" else "tcp"
        if cfg.helper and self.server is not None:
            if loader is None:
                raise ConfigError("[peers] helper = true: this store cannot load pages for others")
            self._helper = Helper(loader, page_bytes, self._net, kind, self.node_id)
            self.server.store.methods["push"] = self._helper.handle
        landing = cfg.landing_endpoint()
        if not cfg.helpers or landing is None:
            return
        helpers = cfg.helper_endpoints()
        if self.address is not None and self.address in helpers:
            raise ConfigError(f"[peers] helpers names this node's own serve address {cfg.serve!r}: a node cannot "
                              "read for itself")
        try:
            zone = Landing(landing[0], landing[1], cfg.landing_pages, page_bytes, self._net, secret, rdma=kind == "rdma")
        except OSError as exc:
            raise ConfigError(f"[peers] landing = {cfg.landing!r}: cannot listen there: {exc}") from None
        self._loads = Loads(cfg.dualpath, helpers, zone, self._net, self.node_id)

    @property
    def address(self) -> tuple[str, int] | None:
        return self.server.address if self.server is not None else None

    # -- serving -----------------------------------------------------------------------
    @contextlib.contextmanager
    def placing(self, blob: bytes, salt: bytes) -> Iterator[None]:
        """Pages the store places meanwhile that are among ``blob``'s keys belong to the
        tenant of ``salt`` (the request's): so they are tagged, for tenant principals."""
        if self.server is None or not (self._tagging or self._publisher is not None):
            yield
            return
        self._request, self._request_keys = (blob, tenant_tag(salt)), None
        try:
            yield
        finally:
            self._request = self._request_keys = None

    def _tags(self, keys: list[PageKey]) -> list[int] | None:
        if not self._tagging:
            return None
        if self._request is None:
            return [UNKNOWN_TENANT] * len(keys)
        _blob, tag = self._request
        mine = self._request_positions()
        return [tag if k in mine else UNKNOWN_TENANT for k in keys]

    def _request_positions(self) -> dict[bytes, int]:
        """The placing request's keys and their positions in its chain."""
        assert self._request is not None
        if self._request_keys is None:
            self._request_keys = {k: i for i, k in enumerate(split_keys(self._request[0]))}
        return self._request_keys

    def _positions(self, keys: list[PageKey], cap: int) -> list[int]:
        """Each placed page's position in its chain, where below ``cap``, else -1: from the
        placing request (which knows them), else by walking the parent links."""
        if self._request is not None:
            where = self._request_positions()
            got = [where.get(k, -1) for k in keys]
            if all(p >= 0 for p in got):
                return [p if p < cap else -1 for p in got]
        return self._manager.shallow_depths(keys, cap).tolist()  # type: ignore[no-any-return]

    def _on_event(self, event: str, tier: TierId, keys: list[PageKey], slots: list[int]) -> None:
        if self.server is None or tier != self._served:
            return
        publisher = self._publisher
        if event == "placed":
            self._generation += 1
            self.server.store.seal(keys, slots, self._generation, self._page_bytes, self._tags(keys))
            if publisher is not None:   # announced after the bytes are readable here
                publisher.placed(keys, self._positions(keys, publisher.depth_cap))
        else:
            if publisher is not None:
                publisher.removed(keys)
            self.server.store.unseal(keys, slots)

    def set_directory(self, publisher: Publishing | None, route: Route | None) -> None:
        """The cluster's page directory (:mod:`tierkv.cluster.directory`): ``publisher`` is
        told the pages this node serves (placed, with their positions, and removed);
        ``route(chain)`` names the cluster peers holding a chain's leading pages, best
        first (None: it cannot say, and every cluster peer is asked)."""
        self._publisher = publisher if self.server is not None else None
        self._route = route

    # -- fetching ----------------------------------------------------------------------
    def fetch(self, chain: Sequence[PageKey], start: int, rows: np.ndarray, salt: bytes, *,
              dualpath: bool = True, deadline: float | None = None) -> int:
        """Load the leading pages of ``chain[start:]`` (a prompt's keys from its first page,
        of the tenant of ``salt``) that some peer holds into ``rows``; returns how many. A
        node whose principal is one tenant's asks peers only for that tenant's pages.

        Stops at the first page no reachable peer returns intact. Never raises for a peer's
        failure: an unreachable or slow peer is a miss within ``timeout_s``. With
        ``[peers] helpers``, the pages a peer holds are divided between this node's reads
        and a helper's push (:mod:`tierkv.dualpath.loads`); ``dualpath=False`` (a helper
        loading for another node) reads them all here. With a ``deadline``
        (``time.monotonic()``), a peer is asked only if connected by then, and none once it
        has passed (each one asked still has ``timeout_s``).
        """
        if self._own_tag is not None and tenant_tag(salt) != self._own_tag:
            return 0
        keys = chain[start:]
        got = 0
        for ep in self._asked(chain):
            if got == len(keys) or (deadline is not None and time.monotonic() >= deadline):
                break
            # A peer the cluster named is asked once connected (connecting runs in the
            # background): an address etcd published that does not answer must not stall gets.
            if deadline is not None:   # connected, or connecting by the deadline
                fut = self._client_future(ep)
                tier = _within(fut, deadline) if fut is not None else None
            else:
                tier = self._connected_now(ep) if ep in self._cluster else self._client(ep)
            if tier is None:
                continue
            try:
                metas = tier.lookup(list(keys[got:]))
                lead = next((i for i, m in enumerate(metas) if m is None), len(metas))
                if lead == 0:
                    continue
                held = [m for m in metas[:lead] if m is not None]
                part = list(keys[got:got + lead])

                def own(first: int, stop: int, dst: np.ndarray) -> int:
                    res = tier.fetch_remote(held[first:stop], dst, part[first:stop])
                    return next((i for i, ok in enumerate(res.ok) if not ok), len(res.ok))

                if self._loads is not None and dualpath:
                    n = self._loads.fetch(chain, start + got, lead, rows[got:got + lead], salt, own)
                else:
                    n = own(0, lead, rows[got:got + lead])
            except TierKVError as exc:
                log.warning("peer %s:%d failed (%s); its pages are misses for now", ep[0], ep[1], exc)
                self._drop(ep, tier)
                continue
            got += n
        return got

    def awaiting_push(self) -> bool:
        """Whether a fetch of this node's is waiting on a helper's answer now (holding the
        store's lock: a push asked of this node meanwhile may be the one it waits on)."""
        return self._loads is not None and self._loads.waiting > 0

    def dualpath_stats(self) -> dict[str, dict[str, float]] | None:
        """What DualPath did here (``loads``: fetches divided with helpers, and
        ``rates_bytes_s`` and ``latency_s``: each side's cost as measured; ``helper``:
        pushes served for others), or None where it is not configured."""
        out: dict[str, dict[str, float]] = {}
        if self._loads is not None:
            out["loads"] = self._loads.stats()
            out["rates_bytes_s"], out["latency_s"] = self._loads.rates()
        if self._helper is not None:
            out["helper"] = self._helper.stats()
        return out or None

    def lookup(self, chain: Sequence[PageKey], start: int, salt: bytes | None) -> int:
        """How many of the leading ``chain[start:]`` a :meth:`fetch` would find on the peers: each
        peer is asked once, all at once, which of them it holds, and the answers are read
        in the order ``fetch`` asks the peers (each continuing the run where the one
        before stopped). ``salt``: the tenant's, when known (a node whose principal is
        one tenant's asks for that tenant's pages only; the peers enforce it either way).

        Never raises and never waits past ``LOOKUP_TIMEOUT_S`` (or ``timeout_s``): a peer
        that is not connected yet, cannot be reached or answers late is a miss. Thread-safe.
        """
        keys = chain[start:]
        if not self._peers or not keys or (salt is not None and self._own_tag is not None
                                           and tenant_tag(salt) != self._own_tag):
            return 0
        order = self._asked(chain)
        deadline = time.monotonic() + min(LOOKUP_TIMEOUT_S, self.cfg.timeout_s)
        body = encode_keys(list(keys[:MAX_LOOKUP_KEYS]))
        now = time.monotonic()
        clients = [(ep, self._client_future(ep)) for ep in order if now >= self._quiet_until.get(ep, 0.0)]
        asked: dict[Endpoint, Future[CallResult]] = {}
        for first in (True, False):   # connected peers are asked first, then those connecting meanwhile
            for ep, fut in clients:
                if fut is None or (first and not fut.done()) or ep in asked:
                    continue
                tier = _within(fut, deadline)
                if tier is not None:
                    try:
                        asked[ep] = tier.transport.call("lookup", body, next(self._channels) % 8)
                    except TierKVError:   # closed under us (dropped by a fetch, or the store's close)
                        continue
        held = {ep: h for ep, call in asked.items() if (h := self._answer(ep, call, deadline, len(keys))) is not None}
        got = 0
        for ep in order:   # in fetch's order: each peer continues the run where the one before stopped
            h = held.get(ep)
            if h is not None:
                got += next((i for i, ok in enumerate(h[got:]) if not ok), len(h) - got)
        return got

    def _asked(self, chain: Sequence[PageKey]) -> list[Endpoint]:
        """The peers a fetch or lookup of ``chain`` asks, in order: the ``[peers] fetch``
        ones, then the cluster's: those the directory names, or all where it cannot say."""
        peers, route = list(self._peers), self._route
        if route is None or not self._cluster:
            return peers
        try:
            named = route(chain)
        except Exception:   # noqa: BLE001 - a directory's fault is a hint lost, not a failed get
            log.exception("tierkv: the page directory failed a lookup; asking every member")
            named = None
        if named is None:
            return peers
        cluster = self._cluster
        return [ep for ep in peers if ep not in cluster] + [ep for ep in dict.fromkeys(named) if ep in cluster]

    def _answer(self, ep: Endpoint, call: Future[CallResult], deadline: float, n: int) -> list[bool] | None:
        """Which keys the peer at ``ep`` holds, from its answer to a lookup call; None for
        an answer that did not come by ``deadline`` (the peer is then quiet for lookups
        for ``RETRY_S``), failed, or does not add up."""
        try:
            res = call.result(timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            call.cancel()
            self._quiet_until[ep] = time.monotonic() + RETRY_S
            log.warning("peer %s:%d did not answer a lookup within %.3f s; lookups skip it for %.0f s", ep[0], ep[1],
                        min(LOOKUP_TIMEOUT_S, self.cfg.timeout_s), RETRY_S)
            return None
        if not res.ok:
            return None
        try:
            metas = decode_metas(res.body)
        except TierKVError:
            return None
        return [m.generation != 0 for m in metas] if len(metas) == min(n, MAX_LOOKUP_KEYS) else None

    def _connected_now(self, ep: Endpoint) -> PeerDramTier | None:
        """The connection to ``ep`` if it is made; else None (and it is being made)."""
        fut = self._client_future(ep)
        return fut.result() if fut is not None and fut.done() else None

    def _client(self, ep: Endpoint) -> PeerDramTier | None:
        """The connection to the peer at ``ep``, made now if needed (within the transport's
        connect timeout); None while it cannot be reached."""
        fut = self._client_future(ep)
        return None if fut is None else fut.result()

    def _client_future(self, ep: Endpoint) -> Future[PeerDramTier | None] | None:
        """The connection to ``ep``: made, or being made on a thread of its own (the
        future's result is None if that fails); None while waiting to try again."""
        with self._lock:
            tier = self._peers.get(ep)
            if tier is not None:
                done: Future[PeerDramTier | None] = Future()
                done.set_result(tier)
                return done
            fut = self._connecting.get(ep)
            if fut is not None or self._closed or time.monotonic() < self._next_try.get(ep, 0.0):
                return fut
            fut = self._connecting[ep] = Future()
        try:
            threading.Thread(target=self._connect, args=(ep, fut), name="tierkv-peer-connect", daemon=True).start()
        except RuntimeError:   # no thread to be had: a miss, tried again later
            self._connected(ep, fut, None)
        return fut

    def _connect(self, ep: Endpoint, fut: Future[PeerDramTier | None]) -> None:
        try:
            tier: PeerDramTier | None = PeerDramTier(connect(ep[0], ep[1], self.cfg.transport,  # type: ignore[arg-type]
                                                             self._net))
        except TierKVError as exc:
            log.warning("peer %s:%d unreachable (%s); retrying in %.0f s", ep[0], ep[1], exc, RETRY_S)
            tier = None
        self._connected(ep, fut, tier)

    def _connected(self, ep: Endpoint, fut: Future[PeerDramTier | None], tier: PeerDramTier | None) -> None:
        with self._lock:
            del self._connecting[ep]
            if tier is None:
                self._next_try[ep] = time.monotonic() + RETRY_S
            elif self._closed or ep not in self._peers:   # closed, or left the cluster, while connecting
                tier.close()
                tier = None
            else:
                self._peers[ep] = tier
        fut.set_result(tier)

    def set_cluster_peers(self, endpoints: Sequence[Endpoint]) -> None:
        """The peers the cluster's members name (:mod:`tierkv.cluster`), asked after the
        ``[peers] fetch`` ones; a peer no longer named is dropped (its connection closed).
        Fetches and lookups running meanwhile finish over the list they began with."""
        static = self.cfg.fetch_endpoints()
        cluster = [ep for ep in dict.fromkeys(endpoints) if ep not in static and ep != self.address]
        want = static + cluster
        with self._lock:
            if self._closed or list(self._peers) == want:
                return
            peers = {ep: self._peers.get(ep) for ep in want}
            gone = [t for ep, t in self._peers.items() if ep not in peers and t is not None]
            # Readers go without the lock: whatever list of peers they hold, each of its
            # members is in _cluster (never taken for a static peer, whose connect blocks).
            self._cluster = self._cluster | set(cluster)
            self._peers = peers   # a new dict: iterations over the old one are not disturbed
            self._cluster = set(cluster)
            for table in (self._next_try, self._quiet_until):
                for ep in [e for e in table if e not in peers]:
                    del table[ep]
        for tier in gone:
            tier.close()
        for ep in cluster:   # connect now, in the background: a get does not wait for these
            self._client_future(ep)

    @property
    def peers(self) -> list[Endpoint]:
        """The peers a fetch asks, in order."""
        return list(self._peers)

    def _drop(self, ep: Endpoint, tier: PeerDramTier) -> None:
        with self._lock:
            if self._peers.get(ep) is tier:
                self._peers[ep] = None
                self._next_try[ep] = time.monotonic() + RETRY_S
        tier.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            tiers = [t for t in self._peers.values() if t is not None]
            self._peers = dict.fromkeys(self._peers)
        for tier in tiers:
            tier.close()
        if self._loads is not None:
            self._loads.close()
        if self.server is not None:
            self.server.close()
        if self._helper is not None:   # after the server: no push is served past this
            self._helper.close()


def _within(fut: Future[PeerDramTier | None], deadline: float) -> PeerDramTier | None:
    """The connection ``fut`` makes, if made by ``deadline`` (the connect goes on after)."""
    try:
        return fut.result(timeout=max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        return None
