"""Cluster membership: each node daemon under a lease in etcd, and every node's view of the others.

Key layout (docs/cluster.md): ``/tierkv/{cluster}/nodes/{node}`` holds a node's
:class:`NodeRecord` (JSON), put under a lease of ``lease_ttl_s`` that the node renews every
third of it. A node that stops renewing (killed, partitioned away from etcd) vanishes with
its lease, and everything it put under that lease with it, within ``lease_ttl_s`` of its
last renewal; a node that closes revokes its lease, and vanishes at once.

- :class:`Membership`: one node's registration. The first registration refuses a node name
  another live node holds (a second daemon started with the same ``[cluster] node``);
  after that, a lease found expired (etcd was away longer than the TTL, or this process
  was paused) is replaced by a new one and the record put again, with the new lease as its
  ``epoch``: others tell a node that came back from the one they knew. While etcd does not
  answer the node goes on serving its own tiers and keeps trying (``etcd_away`` says so).
- :class:`NodeView`: the members as one node sees them, from a listing kept current by a
  watch; a broken watch (etcd restarted, the connection lost) lists again and watches on
  from that listing's revision, so no change is missed. While etcd is away the view keeps
  the last members it knew and says it is ``stale``.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from tierkv.cluster.etcd import Etcd, Event
from tierkv.errors import ClusterUnavailableError, ConfigError, InputError

log = logging.getLogger(__name__)

#: Seconds between attempts to reach etcd again after it did not answer.
RETRY_S = 1.0


def nodes_prefix(cluster: str) -> bytes:
    return f"/tierkv/{cluster}/nodes/".encode()


def check_name(name: object, what: str) -> str:
    """A cluster or node name: 1-128 characters of letters, digits, ``-``, ``_`` and ``.``."""
    if not isinstance(name, str) or not 0 < len(name) <= 128 or not all(c.isalnum() or c in "-_." for c in name):
        raise ConfigError(f"{what} must be 1-128 letters, digits, '-', '_' or '.', got {name!r}")
    return name


def default_node_name() -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())[:128] or "node"


@dataclass(frozen=True)
class NodeRecord:
    """What a node publishes about itself. ``epoch``: the lease it registered under (a node
    that registers again, after a restart or a lost lease, has another). ``peer``: where
    its peer server serves its DRAM pages (``host:port``), if it does; ``layout``: the
    fingerprint of its store's layout (only nodes of one model and layout share pages)."""

    node: str
    epoch: int
    model_id: str
    layout: str
    peer: str | None = None
    transports: tuple[str, ...] = ()
    tiers: tuple[str, ...] = ()
    started: float = field(default_factory=time.time)

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> NodeRecord:
        """A record from etcd; InputError naming the fault when it is not one."""
        try:
            d = json.loads(data)
            return cls(node=str(d["node"]), epoch=int(d["epoch"]), model_id=str(d["model_id"]),
                       layout=str(d["layout"]), peer=None if d.get("peer") is None else str(d["peer"]),
                       transports=tuple(str(t) for t in d.get("transports", ())),
                       tiers=tuple(str(t) for t in d.get("tiers", ())), started=float(d.get("started", 0.0)))
        except (ValueError, KeyError, TypeError) as exc:
            raise InputError(f"a node record in etcd is not one ({exc}): {data[:200]!r}") from None


class Membership:
    """This node's registration under a lease, renewed on a thread of its own."""

    def __init__(self, etcd: Etcd, cluster: str, record: Callable[[int], NodeRecord], ttl_s: int = 10) -> None:
        """``record(epoch)``: the record to publish under the lease ``epoch``."""
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, int) or not 2 <= ttl_s <= 3600:
            raise ConfigError(f"cluster.lease_ttl_s must be a whole number of seconds in [2, 3600], got {ttl_s!r}")
        self.etcd = etcd
        self.cluster = check_name(cluster, "cluster.name")
        self._record = record
        self.ttl_s = ttl_s
        self.lease = 0
        self.node = ""
        self.etcd_away = False
        self.registrations = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def key(self) -> bytes:
        return nodes_prefix(self.cluster) + self.node.encode()

    def start(self) -> Membership:
        """Register now (ConfigError when another live node has this node's name); when etcd
        does not answer, go on and register from the renewing thread once it does."""
        try:
            self._register(first=True)
        except ClusterUnavailableError as exc:
            log.warning("tierkv: etcd does not answer (%s); this node serves its own tiers and joins the "
                        "cluster when etcd answers", exc)
            self.etcd_away = True
        self._thread = threading.Thread(target=self._renew, name="tierkv-cluster-lease", daemon=True)
        self._thread.start()
        return self

    def _register(self, first: bool) -> None:
        lease = self.etcd.grant(self.ttl_s)
        record = self._record(lease)
        self.node = check_name(record.node, "cluster.node")
        if not self.etcd.create(self.key, record.encode(), lease):
            held = self.etcd.get(self.key)
            self.etcd.revoke(lease)
            raise ConfigError(f"node {self.node!r} is already a live member of cluster {self.cluster!r} (under lease "
                              f"{held.lease if held else '?'}): give this daemon another [cluster] node name, or stop "
                              f"the other one{'' if first else ' (this node stays out of the cluster until then)'}")
        with self._lock:
            self.lease = lease
            self.registrations += 1
        log.info("tierkv: node %s joined cluster %s (lease %x, ttl %d s)", self.node, self.cluster, lease, self.ttl_s)

    def _renew(self) -> None:
        interval = max(0.5, self.ttl_s / 3)
        while not self._stop.wait(RETRY_S if self.etcd_away or not self.lease else interval):
            try:
                if not self.lease or self.etcd.keepalive(self.lease) < 0:
                    if self.lease:
                        log.warning("tierkv: node %s's lease expired (etcd away, or this process paused, longer "
                                    "than %d s); registering again", self.node, self.ttl_s)
                        with self._lock:
                            self.lease = 0
                    self._register(first=False)
                if self.etcd_away:
                    log.warning("tierkv: etcd answers again; node %s is a member of cluster %s", self.node,
                                self.cluster)
                self.etcd_away = False
            except ClusterUnavailableError as exc:
                if not self.etcd_away:
                    log.warning("tierkv: etcd does not answer (%s); this node goes on serving its own tiers", exc)
                self.etcd_away = True
            except ConfigError as exc:   # our name taken meanwhile: stay out, say so, try again later
                log.error("tierkv: %s", exc)
                self.etcd_away = False

    def close(self) -> None:
        """Leave the cluster now (revoke the lease: the record goes at once)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.etcd.timeout_s * 2 + 1)
        with self._lock:
            lease, self.lease = self.lease, 0
        if lease:
            try:
                self.etcd.revoke(lease)
            except ClusterUnavailableError as exc:   # the lease expires by itself
                log.warning("tierkv: could not leave cluster %s at once (%s); the record goes within %d s",
                            self.cluster, exc, self.ttl_s)


class NodeView:
    """The cluster's members as this process sees them, kept current by a watch."""

    def __init__(self, etcd: Etcd, cluster: str) -> None:
        self.etcd = etcd
        self.cluster = check_name(cluster, "cluster.name")
        self._prefix = nodes_prefix(self.cluster)
        self._nodes: dict[str, NodeRecord] = {}
        self._cond = threading.Condition()
        self.stale = True
        self.revision = 0
        self._cancel: Callable[[], None] | None = None
        self._closed = False
        self._relister: threading.Thread | None = None

    def start(self) -> NodeView:
        """List the members and watch them; when etcd does not answer, keep trying from a
        thread (the view is ``stale`` and empty until then)."""
        try:
            self._list_and_watch()
        except ClusterUnavailableError as exc:
            log.warning("tierkv: cannot list the cluster's nodes yet (%s)", exc)
            self._broken(exc)
        return self

    def _list_and_watch(self) -> None:
        revision, kvs = self.etcd.get_prefix(self._prefix)
        nodes = {}
        for kv in kvs:
            rec = self._decode(kv.key, kv.value)
            if rec is not None:
                nodes[rec.node] = rec
        with self._cond:
            if self._closed:
                return
            self._nodes, self.revision, self.stale = nodes, revision, False
            self._cond.notify_all()
        cancel = self.etcd.watch_prefix(self._prefix, revision + 1, self._events, self._broken)
        with self._cond:
            closed = self._closed
            if not closed:
                self._cancel = cancel
        if closed:
            cancel()

    def _decode(self, key: bytes, value: bytes) -> NodeRecord | None:
        try:
            rec = NodeRecord.decode(value)
        except InputError as exc:
            log.warning("tierkv: ignoring %r: %s", key, exc)
            return None
        if key != self._prefix + rec.node.encode():
            log.warning("tierkv: ignoring %r: it names node %r", key, rec.node)
            return None
        return rec

    def _events(self, events: list[Event]) -> None:
        with self._cond:
            for ev in events:
                name = ev.kv.key[len(self._prefix):].decode(errors="replace")
                if ev.deleted:
                    self._nodes.pop(name, None)
                else:
                    rec = self._decode(ev.kv.key, ev.kv.value)
                    if rec is not None:
                        self._nodes[rec.node] = rec
                self.revision = max(self.revision, ev.kv.mod_revision)
            self._cond.notify_all()

    def _broken(self, error: Exception | None) -> None:
        with self._cond:
            if self._closed:
                return
            self.stale = True
            self._cond.notify_all()
        log.info("tierkv: the watch of cluster %s's nodes ended (%s); listing again", self.cluster, error)
        self._relister = threading.Thread(target=self._relist, name="tierkv-cluster-relist", daemon=True)
        self._relister.start()

    def _relist(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
            try:
                self._list_and_watch()
                return
            except ClusterUnavailableError:
                with self._cond:
                    self._cond.wait(RETRY_S)

    def nodes(self) -> dict[str, NodeRecord]:
        """The members last seen (``stale`` says whether etcd confirmed them lately)."""
        with self._cond:
            return dict(self._nodes)

    def wait(self, cond: Callable[[dict[str, NodeRecord]], bool], timeout_s: float) -> bool:
        """Wait until ``cond(members)`` holds; whether it did within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not cond(dict(self._nodes)):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._cancel is not None:
            self._cancel()
