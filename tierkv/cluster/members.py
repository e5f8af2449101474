"""Cluster membership: each node daemon under a lease in etcd, and every node's view of the others.

Key layout (docs/cluster.md): ``/tierkv/{cluster}/nodes/{node}`` holds a node's
:class:`NodeRecord` (JSON), put under a lease of ``lease_ttl_s`` that the node renews every
third of it. A node that stops renewing (killed, partitioned away from etcd) vanishes with
its lease, and everything it put under that lease with it, within ``lease_ttl_s`` of its
last renewal; a node that closes revokes its lease, and vanishes at once.

- :class:`Membership`: one node's registration. A registration refuses a node name another
  live node holds (a second daemon started with the same ``[cluster] node``: at start an
  error, later a logged error and a retry every TTL); a record left by this same store on
  this host (the daemon crashed and restarted within the TTL: the store's lock proves the
  old daemon is gone) is taken over at once. A lease found expired (etcd was away longer
  than the TTL, or this process was paused) is replaced by a new one and the record put
  again, with the new lease as its ``epoch``: others tell a node that came back from the
  one they knew. While etcd does not answer the node goes on serving its own tiers and
  keeps trying (``etcd_away`` says so). A lease granted for a registration that then
  failed is revoked; one a closing registration got is revoked by it.
- :class:`NodeView`: the members as one node sees them, from a listing kept current by a
  watch. A thread checks the listing's keys and revisions every ``check_s`` against what
  the watch delivered: when etcd does not answer the view is ``stale`` (it keeps the last
  members it knew), and when the two differ twice in a row (a watch left silent by a
  partition, or broken) or the view was stale, it lists again and watches on from that
  listing's revision, so no change is missed for long.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from tierkv.cluster.etcd import Etcd, Event
from tierkv.layout import KVLayout
from tierkv.config import check_name
from tierkv.errors import ClusterRefusedError, ClusterUnavailableError, ConfigError, InputError

log = logging.getLogger(__name__)

#: Seconds between attempts to reach etcd again after it did not answer.
RETRY_S = 1.0


def nodes_prefix(cluster: str) -> bytes:
    return f"/tierkv/{cluster}/nodes/".encode()


def layout_digest(layout: KVLayout) -> str:
    """What a record says of its store's layout: a digest of the layout's fingerprint."""
    return hashlib.sha256(layout.fingerprint()).hexdigest()[:32]


def default_node_name() -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())[:128] or "node"


@dataclass(frozen=True)
class NodeRecord:
    """What a node publishes about itself. ``epoch``: the lease it registered under (a node
    that registers again, after a restart or a lost lease, has another). ``peer``: where
    its peer server serves its DRAM pages (``host:port``), if it does; ``layout``: the
    fingerprint of its store's layout (only nodes of one model and layout share pages);
    ``host`` and ``store``: the machine and the store's random identity (a daemon that
    restarts on the same store takes over its own record; two stores never share one)."""

    node: str
    epoch: int
    model_id: str
    layout: str
    peer: str | None = None
    transports: tuple[str, ...] = ()
    tiers: tuple[str, ...] = ()
    started: float = field(default_factory=time.time)
    host: str = ""
    store: str = ""

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    def peer_endpoint(self) -> tuple[str, int] | None:
        """``peer`` as (host, port), or None (none, or not ``host:port``)."""
        if self.peer is None:
            return None
        host, _, port = self.peer.rpartition(":")
        return (host.strip("[]"), int(port)) if host and port.isdigit() else None

    @classmethod
    def decode(cls, data: bytes) -> NodeRecord:
        """A record from etcd; InputError naming the fault when it is not one."""
        try:
            d = json.loads(data)
            return cls(node=str(d["node"]), epoch=int(d["epoch"]), model_id=str(d["model_id"]),
                       layout=str(d["layout"]), peer=None if d.get("peer") is None else str(d["peer"]),
                       transports=tuple(str(t) for t in d.get("transports", ())),
                       tiers=tuple(str(t) for t in d.get("tiers", ())), started=float(d.get("started", 0.0)),
                       host=str(d.get("host", "")), store=str(d.get("store", "")))
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
        #: Called with each lease this node registers under, and 0 when it is found gone
        #: (on the registering thread; must not block): the page directory's publisher
        #: puts its anchors under it.
        self.on_lease: list[Callable[[int], None]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def key(self) -> bytes:
        return nodes_prefix(self.cluster) + self.node.encode()

    @property
    def member(self) -> bool:
        """Whether this node holds a lease that etcd confirmed at its last renewal."""
        return bool(self.lease) and not self.etcd_away

    def start(self) -> Membership:
        """Register now (ConfigError when another live node has this node's name); when etcd
        does not answer, go on and register from the renewing thread once it does."""
        try:
            self._register(first=True)
        except ClusterUnavailableError as exc:
            log.warning("tierkv: etcd does not answer (%s); this node serves its own tiers and joins the "
                        "cluster when etcd answers", exc)
            self.etcd_away = True
        except ClusterRefusedError as exc:
            log.error("tierkv: etcd refused this node's registration (%s); it serves its own tiers and tries "
                      "again", exc)
        self._thread = threading.Thread(target=self._renew, name="tierkv-cluster-lease", daemon=True)
        self._thread.start()
        return self

    def _register(self, first: bool) -> None:
        lease = self.etcd.grant(self.ttl_s)
        try:
            if self._stop.is_set():
                raise _Closing
            record = self._record(lease)
            self.node = check_name(record.node, "cluster.node")
            if not self.etcd.create(self.key, record.encode(), lease) and not self._take_over(record, lease):
                held = self.etcd.get(self.key)
                raise ConfigError(
                    f"node {self.node!r} is already a live member of cluster {self.cluster!r} (under lease "
                    f"{held.lease if held else 0:x}): give this daemon another [cluster] node name, or stop the "
                    f"other one{'' if first else ' (this node stays out of the cluster until then)'}")
            with self._lock:
                if self._stop.is_set():   # closed meanwhile: close() saw no lease, so this thread ends it
                    raise _Closing
                self.lease = lease
                self.registrations += 1
        except BaseException:
            try:   # whatever happened (a create whose answer was lost included), no lease of ours stays
                self.etcd.revoke(lease)
            except (ClusterUnavailableError, ClusterRefusedError) as exc:
                log.info("tierkv: revoking lease %x: %s (it expires within %d s)", lease, exc, self.ttl_s)
            raise
        log.info("tierkv: node %s joined cluster %s (lease %x, ttl %d s)", self.node, self.cluster, lease, self.ttl_s)
        self._tell_lease(lease)

    def _tell_lease(self, lease: int) -> None:
        for listener in list(self.on_lease):
            try:
                listener(lease)
            except Exception:   # noqa: BLE001 - a listener's fault must not undo the registration
                log.exception("tierkv: a listener of node %s's lease failed", self.node)

    def _take_over(self, record: NodeRecord, lease: int) -> bool:
        """Replace the record of this node's name when it is this same store's, left by a
        daemon that died (the store's lock, which this daemon holds, proves it gone)."""
        held = self.etcd.get(self.key)
        if held is None:   # gone meanwhile: try again now
            return self.etcd.create(self.key, record.encode(), lease)
        try:
            old = NodeRecord.decode(held.value)
        except InputError:
            return False
        if not record.store or (old.host, old.store) != (record.host, record.store) or held.lease == lease:
            return False
        if not self.etcd.replace(self.key, held.mod_revision, record.encode(), lease):
            return False
        log.warning("tierkv: node %s took over its record from a daemon of this store that stopped (lease %x)",
                    self.node, held.lease)
        try:
            self.etcd.revoke(held.lease)
        except (ClusterUnavailableError, ClusterRefusedError):
            pass
        return True

    def _renew(self) -> None:
        interval = max(0.5, self.ttl_s / 3)
        wait = interval
        while not self._stop.wait(wait):
            wait = RETRY_S if self.etcd_away or not self.lease else interval
            try:
                if not self.lease or self.etcd.keepalive(self.lease) < 0:
                    if self.lease:
                        log.warning("tierkv: node %s's lease expired (etcd away, or this process paused, longer "
                                    "than %d s); registering again", self.node, self.ttl_s)
                        with self._lock:
                            self.lease = 0
                        self._tell_lease(0)
                    self._register(first=False)
                if self.etcd_away:
                    log.warning("tierkv: etcd answers again; node %s is a member of cluster %s", self.node,
                                self.cluster)
                self.etcd_away = False
                wait = interval
            except _Closing:
                return
            except ClusterUnavailableError as exc:
                if not self.etcd_away:
                    log.warning("tierkv: etcd does not answer (%s); this node goes on serving its own tiers", exc)
                self.etcd_away = True
            except ClusterRefusedError as exc:   # etcd is there and said no: say so, try again shortly
                log.error("tierkv: etcd refused a renewal or registration of node %s: %s", self.node, exc)
                self.etcd_away = False
                wait = RETRY_S
            except ConfigError as exc:   # our name taken meanwhile: stay out, say so, try again a TTL later
                log.error("tierkv: %s", exc)
                self.etcd_away = False
                wait = self.ttl_s

    def close(self) -> None:
        """Leave the cluster now (revoke the lease: the record goes at once). A registration
        still running revokes what it gets."""
        with self._lock:
            self._stop.set()
            lease, self.lease = self.lease, 0
        if lease:
            try:
                self.etcd.revoke(lease)
            except (ClusterUnavailableError, ClusterRefusedError) as exc:   # the lease expires by itself
                log.warning("tierkv: could not leave cluster %s at once (%s); the record goes within %d s",
                            self.cluster, exc, self.ttl_s)
        if self._thread is not None:
            self._thread.join(timeout=self.etcd.timeout_s * 2 + 1)


class _Closing(Exception):
    """A registration that found its membership closing."""


class NodeView:
    """The cluster's members as this process sees them, kept current by a watch."""

    def __init__(self, etcd: Etcd, cluster: str, check_s: float = 1.0) -> None:
        self.etcd = etcd
        self.cluster = check_name(cluster, "cluster.name")
        self.check_s = check_s
        self._prefix = nodes_prefix(self.cluster)
        self._nodes: dict[str, NodeRecord] = {}
        self._mods: dict[bytes, int] = {}   # key -> mod_revision, as the listing and the watch gave them
        self._cond = threading.Condition()
        self._tell_lock = threading.Lock()
        self.stale = True
        self.relists = 0
        self._generation = 0
        self._cancel: Callable[[], None] | None = None
        self._closed = False
        self._checker: threading.Thread | None = None
        #: Called with the members after each change (on the view's threads; must not block).
        self.listeners: list[Callable[[dict[str, NodeRecord]], None]] = []

    def start(self) -> NodeView:
        """List the members and watch them (when etcd does not answer, the view is ``stale``
        and empty until it does); then check them every ``check_s`` on a thread."""
        try:
            self._list_and_watch()
        except (ClusterUnavailableError, ClusterRefusedError) as exc:
            log.warning("tierkv: cannot list the cluster's nodes yet (%s)", exc)
        self._checker = threading.Thread(target=self._check, name="tierkv-cluster-view", daemon=True)
        self._checker.start()
        return self

    def _list_and_watch(self) -> None:
        """List again and watch from there (only the checking thread, or start(), calls it)."""
        revision, kvs = self.etcd.get_prefix(self._prefix)
        nodes, mods = {}, {}
        for kv in kvs:
            mods[kv.key] = kv.mod_revision
            rec = self._decode(kv.key, kv.value)
            if rec is not None:
                nodes[rec.node] = rec
        with self._cond:
            if self._closed:
                return
            old, self._cancel = self._cancel, None
            self._generation += 1
            generation = self._generation
            self._nodes, self._mods, self.stale = nodes, mods, False
            self.relists += 1
            self._cond.notify_all()
        if old is not None:
            threading.Thread(target=old, name="tierkv-cluster-unwatch", daemon=True).start()   # may take a while
        self._tell()
        cancel = self.etcd.watch_prefix(self._prefix, revision + 1,
                                        lambda evs: self._events(generation, evs), lambda exc: self._broken(generation, exc))
        with self._cond:
            current = self._generation == generation and not self._closed
            if current:
                self._cancel = cancel
        if not current:
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

    def _events(self, generation: int, events: list[Event]) -> None:
        with self._cond:
            if self._closed or generation != self._generation:
                return
            for ev in events:
                name = ev.kv.key[len(self._prefix):].decode(errors="replace")
                if ev.deleted:
                    self._nodes.pop(name, None)
                    self._mods.pop(ev.kv.key, None)
                else:
                    self._mods[ev.kv.key] = ev.kv.mod_revision
                    rec = self._decode(ev.kv.key, ev.kv.value)
                    if rec is not None:
                        self._nodes[rec.node] = rec
                    else:
                        self._nodes.pop(name, None)
            self._cond.notify_all()
        self._tell()

    def _broken(self, generation: int, error: Exception | None) -> None:
        with self._cond:
            if self._closed or generation != self._generation:
                return
            self.stale = True
            self._cond.notify_all()
        log.info("tierkv: the watch of cluster %s's nodes ended (%s); listing again", self.cluster, error)

    def _check(self) -> None:
        """Every ``check_s``: is etcd there, and does the listing match what the watch gave?"""
        differed = False
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed, timeout=self.check_s)
                if self._closed:
                    return
                stale = self.stale
            try:
                _rev, kvs = self.etcd.get_prefix(self._prefix, keys_only=True)
            except (ClusterUnavailableError, ClusterRefusedError):
                with self._cond:
                    self.stale = True
                    self._cond.notify_all()
                continue
            with self._cond:
                same = {kv.key: kv.mod_revision for kv in kvs} == self._mods
            if stale or (not same and differed):
                try:
                    self._list_and_watch()
                except (ClusterUnavailableError, ClusterRefusedError):
                    with self._cond:
                        self.stale = True
                differed = False
            else:
                differed = not same   # once may be the watch's delivery on its way

    def _tell(self) -> None:
        # One at a time, each with the members as they are when it runs: the last call a
        # listener gets is the newest view (a call from an old watch cannot land after it).
        with self._tell_lock:
            nodes = self.nodes()
            for listener in list(self.listeners):
                try:
                    listener(nodes)
                except Exception:   # noqa: BLE001 - a listener's fault must not end the watch
                    log.exception("tierkv: a listener of cluster %s's members failed", self.cluster)

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
            cancel, self._cancel = self._cancel, None
            self._cond.notify_all()
        if cancel is not None:
            cancel()
        if self._checker is not None:
            self._checker.join(timeout=self.etcd.timeout_s * 2 + 1)
