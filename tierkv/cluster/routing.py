"""Routing hints: which members of the cluster hold the longest leading run of a prompt's pages.

A request router sends a request where its prefix already is. :class:`Router` follows the
cluster's members (a :class:`~tierkv.cluster.members.NodeView`) and its page directory (a
:class:`~tierkv.cluster.directory.Directory`), and answers :meth:`Router.best_nodes` by
asking the members the directory names as holding the prompt's anchors, at once, which of
the prompt's page keys their peer servers hold (the peer lookup call of
:mod:`tierkv.store.peering`, authenticated with ``[peers] secret_file``), within
``timeout_s``: a member asked that does not answer in time is left out, never waited for;
members holding none of its anchors are listed with 0 pages, unasked. While the directory
is stale (etcd away, or not listed yet) every member is asked. What a member holds is
what it serves to other nodes: its DRAM tier.

:func:`best_nodes` keeps one :class:`Router` per config for a caller that asks by path.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from tierkv.cluster.directory import Directory
from tierkv.cluster.etcd import Etcd
from tierkv.cluster.members import NodeRecord, NodeView, layout_digest
from tierkv.config import StoreConfig
from tierkv.errors import ConfigError, TierKVError
from tierkv.keys import PageKey, Tokens, as_token_array, chain_keys, namespace_digest, split_keys, tenant_salt
from tierkv.tiers.peer import PeerDramTier


@dataclass(frozen=True)
class Holding:
    """A member and how many leading pages of the prompt it holds (``tier``: where; a
    member's peer server serves its DRAM tier)."""

    node: str
    pages: int
    tier: str
    peer: str


class Router:
    """Routing hints over the cluster ``config.cluster`` names, for the model and layout of
    ``config`` (a router's config: ``[store]``/``[layout]`` say the model, ``[peers]`` the
    secret; no store is opened)."""

    def __init__(self, config: StoreConfig, timeout_s: float = 0.05) -> None:
        from tierkv.net import NetConfig
        from tierkv.net.auth import CLUSTER, Credential, load_secret

        if config.cluster is None:
            raise ConfigError("a Router needs a [cluster] table: the etcd and cluster whose members it asks")
        if config.peers is None or config.peers.secret_file is None:
            raise ConfigError("a Router asks the members' peer servers: it needs [peers] secret_file, the "
                              "cluster's shared secret")
        cc, pc, secret = config.cluster, config.peers, config.peers.secret_file
        self.config, self.timeout_s = config, timeout_s
        principal = CLUSTER if pc.tenant is None else "tenant:" + pc.tenant
        self._net = NetConfig(timeout_s=pc.timeout_s, connect_timeout_s=pc.timeout_s,
                              credential=Credential(principal, load_secret(secret, "[peers] secret_file")))
        self._layout = layout_digest(config.layout)
        self._etcd = Etcd(cc.etcd, cc.timeout_s)
        self._view = NodeView(self._etcd, cc.name).start()
        self.directory = Directory(self._etcd, cc.name).start()
        self._tiers: dict[tuple[str, int], PeerDramTier] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="tierkv-route")

    def members(self) -> list[NodeRecord]:
        """The members of this model and layout that serve pages to others."""
        return [r for r in self._view.nodes().values()
                if r.peer_endpoint() is not None and (r.model_id, r.layout) == (self.config.model_id, self._layout)]

    def best_nodes(self, tokens: Tokens, tenant: str | bytes = "") -> list[Holding]:
        """The members holding the prompt's leading pages, most pages first (ties by name);
        members holding none of its anchors are included (0 pages), members asked that did
        not answer within ``timeout_s`` are not."""
        lay = self.config.layout
        keys = split_keys(chain_keys(as_token_array(tokens), lay.tokens_per_page,
                                     namespace_digest(self.config.model_id, lay, tenant_salt(tenant))))
        members = self.members()
        if self.directory.stale or self._view.stale:
            ask = {r.node for r in members}
        else:
            ask = set(self.directory.holders(keys, {r.node: r.epoch for r in members}))
        asked: dict[str, Future[int]] = {r.node: self._pool.submit(self._held, r, keys) for r in members
                                         if r.node in ask}
        deadline = time.monotonic() + self.timeout_s
        out = []
        for rec in members:
            fut = asked.get(rec.node)
            if fut is None:
                out.append(Holding(rec.node, 0, "dram", rec.peer or ""))
                continue
            try:
                pages = fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except (FutureTimeout, TierKVError):
                continue
            out.append(Holding(rec.node, pages, "dram", rec.peer or ""))
        return sorted(out, key=lambda h: (-h.pages, h.node))

    def _held(self, rec: NodeRecord, keys: list[PageKey]) -> int:
        from tierkv.net import connect

        ep = rec.peer_endpoint()
        assert ep is not None
        with self._lock:
            tier = self._tiers.get(ep)
        if tier is None:
            kind = rec.transports[0] if rec.transports and rec.transports[0] in ("auto", "tcp", "rdma") else "auto"
            tier = PeerDramTier(connect(ep[0], ep[1], kind, self._net))  # type: ignore[arg-type]
            with self._lock:
                tier = self._tiers.setdefault(ep, tier)
        if not keys:
            return 0
        try:
            metas = tier.lookup(keys)
        except TierKVError:
            with self._lock:
                if self._tiers.get(ep) is tier:
                    del self._tiers[ep]
            tier.close()
            raise
        return next((i for i, m in enumerate(metas) if m is None), len(metas))

    def close(self) -> None:
        self.directory.close()
        self._view.close()
        self._etcd.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            tiers, self._tiers = list(self._tiers.values()), {}
        for tier in tiers:
            tier.close()

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_routers: dict[str, Router] = {}
_routers_lock = threading.Lock()


def best_nodes(tokens: Tokens, tenant: str | bytes = "", *, config: str | os.PathLike[str] | StoreConfig,
               timeout_s: float = 0.05) -> list[Holding]:
    """:meth:`Router.best_nodes` through a :class:`Router` kept per ``config`` (a router's
    config file, or a :class:`~tierkv.config.StoreConfig`) for the process's lifetime."""
    from tierkv.config import load_config

    key = repr(config) if isinstance(config, StoreConfig) else os.fspath(config)
    with _routers_lock:
        router = _routers.get(key)
        if router is None:
            cfg = config if isinstance(config, StoreConfig) else load_config(config)
            router = _routers[key] = Router(cfg, timeout_s)
    return router.best_nodes(tokens, tenant)


def close_routers() -> None:
    """Close the routers :func:`best_nodes` keeps."""
    with _routers_lock:
        routers = list(_routers.values())
        _routers.clear()
    for router in routers:
        router.close()
