"""A node daemon's part in its cluster: its membership, its view of the others, and the page
directory (what it publishes, and what it reads to know whom to ask).

Built by :class:`tierkv.serve.daemon.Daemon` from ``[cluster]`` (docs/cluster.md). With a
``[peers]`` table the node also serves and fetches: its store fetches from every other
member of its model and layout, asking first (or only) those the directory names as
holding a prompt's leading pages, and publishes the anchors of the pages its peer server
serves under the node's lease.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

from tierkv.cluster.directory import Directory
from tierkv.cluster.publisher import Publisher
from tierkv.cluster.etcd import Etcd
from tierkv.cluster.members import Membership, NodeRecord, NodeView, default_node_name, layout_digest
from tierkv.config import StoreConfig
from tierkv.errors import ConfigError
from tierkv.keys import PageKey
from tierkv.store.api import Store

Endpoint = tuple[str, int]


class ClusterNode:
    """One daemon's membership, view, directory and publisher; :meth:`close` leaves."""

    def __init__(self, store: Store, config: StoreConfig) -> None:
        cc = config.cluster
        assert cc is not None
        peer = store.peer_address
        if peer is not None and peer[0] in ("0.0.0.0", "::", ""):
            raise ConfigError(f"[peers] serve = {config.peers.serve if config.peers else ''!r} with [cluster]: the "
                              "cluster publishes this address for other nodes to fetch from, so it must be one they "
                              "reach (this node's cluster address), not a wildcard")
        tiers = tuple(name for name in ("hbm", "dram", "nvme", "nvmeof") if getattr(config, name) is not None)
        transports = (config.peers.transport,) if config.peers is not None and peer is not None else ()
        self.store, self.model_id, self.layout = store, config.model_id, layout_digest(store.layout)
        host, ident, node = socket.gethostname(), store.identity(), cc.node or default_node_name()

        def record(epoch: int) -> NodeRecord:
            return NodeRecord(node=node, epoch=epoch, model_id=config.model_id, layout=self.layout,
                              peer=f"{peer[0]}:{peer[1]}" if peer is not None else None,
                              transports=transports, tiers=tiers, host=host, store=ident)

        self.etcd = Etcd(cc.etcd, cc.timeout_s)
        self.view: NodeView | None = None
        self.directory: Directory | None = None
        self.publisher: Publisher | None = None
        self.membership = Membership(self.etcd, cc.name, record, cc.lease_ttl_s)
        try:
            if config.peers is not None:
                if peer is not None:   # what this node serves goes into the directory under its lease
                    self.publisher = Publisher(self.etcd, cc.name, node)
                    self.membership.on_lease.append(self.publisher.set_lease)
                self.directory = Directory(self.etcd, cc.name).start()
                self.view = NodeView(self.etcd, cc.name)
                self.view.listeners.append(self._members_changed)
                store.set_cluster_directory(self.publisher, self._route)
            self.membership.start()
            if self.view is not None:
                self.view.start()
        except BaseException:
            self.close()
            raise

    def _members(self, nodes: dict[str, NodeRecord]) -> dict[str, NodeRecord]:
        me = self.membership.node
        return {name: rec for name, rec in nodes.items() if name != me and rec.peer_endpoint() is not None
                and (rec.model_id, rec.layout) == (self.model_id, self.layout)}

    def _members_changed(self, nodes: dict[str, NodeRecord]) -> None:
        eps = [ep for rec in self._members(nodes).values() if (ep := rec.peer_endpoint()) is not None]
        self.store.set_cluster_peers(eps)

    def _route(self, chain: Sequence[PageKey]) -> list[Endpoint] | None:
        """The members holding ``chain``'s leading pages by the directory, deepest anchor
        first; None while the directory or the view is stale (every member is asked)."""
        view, directory = self.view, self.directory
        if view is None or directory is None or directory.stale or view.stale:
            return None
        members = self._members(view.nodes())
        held = directory.holders(chain, {name: rec.epoch for name, rec in members.items()})
        order = sorted(held.items(), key=lambda kv: (-kv[1], kv[0]))
        return [ep for name, _ in order if (ep := members[name].peer_endpoint()) is not None]

    def status(self) -> dict[str, Any]:
        m = self.membership
        out: dict[str, Any] = {"name": m.cluster, "node": m.node, "member": m.member, "lease": m.lease,
                               "etcd_away": m.etcd_away, "lease_ttl_s": m.ttl_s}
        if self.view is not None:
            out["fetch_peers"] = [f"{h}:{p}" for h, p in self.store.fetch_peers()]
        if self.directory is not None:
            out["directory"] = {"anchors": len(self.directory), "stale": self.directory.stale,
                                "published": self.publisher.stats() if self.publisher is not None else None}
        return out

    def close(self) -> None:
        """Leave the cluster: stop following it, stop publishing, revoke the lease (this
        node's record and anchors go at once)."""
        for part in (self.view, self.directory, self.publisher):
            if part is not None:
                part.close()
        self.membership.close()
        self.etcd.close()
