"""etcd, as the cluster uses it: keys under a prefix, leases, transactions and watches.

Over etcd's JSON gateway (``/v3/``, etcd 3.4 and later) through ``etcd3gw``'s client, one
per endpoint, tried in order: the first that answers serves the call. Every call has a
deadline: ``timeout_s`` for the connection and again for the answer, per endpoint tried
(so at most about ``2 * timeout_s`` per endpoint; endpoints are best given as addresses,
a host name's resolution is not bounded). An endpoint that does not answer (or answers
with a server error) is a :class:`~tierkv.errors.ClusterUnavailableError` once every
endpoint was tried; an answer that refuses the request (a lease not found, a request too
large) is a :class:`~tierkv.errors.ClusterRefusedError` with etcd's own message. Keys and
values are bytes here (the gateway's base64 stays inside this module).

A watch (:meth:`Etcd.watch_prefix`) streams events on a thread of its own from a given
revision, and calls ``on_broken`` once when its stream ends for any reason other than
``cancel()`` (etcd stopped, the connection lost, the revision compacted, or nothing
arrived for ``WATCH_IDLE_S``: a partitioned etcd can leave a stream open and silent).
The caller lists the prefix again and watches from that listing's revision, so no event
between the two is missed; :class:`~tierkv.cluster.members.NodeView` also checks the
listing against what its watch delivered, since a silent stream is not always a broken one.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tierkv.errors import ClusterRefusedError, ClusterUnavailableError, ConfigError
from tierkv.integrations import MissingDependencyError

log = logging.getLogger(__name__)

#: Seconds a watch's stream may stay silent (and its answer take to begin) before it is
#: ended and its owner lists again: an idle cluster's watch starts over this often.
WATCH_IDLE_S = 10.0

#: The most operations one transaction may hold (etcd's default ``--max-txn-ops``).
MAX_TXN_OPS = 128
#: Keys per request of a paged listing (:meth:`Etcd.get_prefix_paged`): each page's answer
#: must come within the call's deadline.
LIST_PAGE = 10_000

INSTALL_HINT = "pip install 'tierkv[cluster]' (etcd3gw), and an etcd 3.4+ server (Debian: apt-get install etcd-server)"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix`` (etcd's ``range_end``)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"   # every key


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    lease: int
    mod_revision: int


@dataclass(frozen=True)
class Event:
    """A watch event: ``deleted`` (a delete, or a lease's expiry) or a put of ``kv``."""

    kv: KeyValue
    deleted: bool


def parse_endpoints(endpoints: Sequence[str]) -> list[tuple[str, int]]:
    """``["host:port", ...]`` (an ``http://`` prefix allowed) as (host, port) pairs."""
    out = []
    for text in endpoints:
        rest = text.removeprefix("http://")
        host, _, port = rest.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in rest:
            raise ConfigError(f"an etcd endpoint is 'host:port' (or http://host:port), got {text!r}")
        out.append((host.strip("[]"), int(port)))
    if not out:
        raise ConfigError("the cluster needs at least one etcd endpoint ('host:port')")
    return out


class Etcd:
    """A client of one etcd cluster; thread-safe (each call is one HTTP request)."""

    def __init__(self, endpoints: Sequence[str], timeout_s: float = 2.0) -> None:
        try:
            from etcd3gw.client import Etcd3Client
        except ImportError:
            raise MissingDependencyError(f"the cluster directory needs etcd3gw: {INSTALL_HINT}") from None
        self.endpoints = parse_endpoints(endpoints)
        self.timeout_s = timeout_s
        self._clients = [Etcd3Client(host=h, port=p, timeout=timeout_s, api_path="/v3/") for h, p in self.endpoints]
        self._first = 0   # the endpoint that answered last
        self._lock = threading.Lock()

    @property
    def where(self) -> str:
        return ", ".join(f"{h}:{p}" for h, p in self.endpoints)

    def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        from etcd3gw.exceptions import (ConnectionFailedError, ConnectionTimeoutError, Etcd3Exception,
                                        InternalServerError)

        with self._lock:
            first = self._first
        errors = []
        for i in range(len(self._clients)):
            k = (first + i) % len(self._clients)
            client = self._clients[k]
            try:
                out: dict[str, Any] = client.post(client.get_url(path), json=body)
            except (ConnectionFailedError, ConnectionTimeoutError, InternalServerError) as exc:
                errors.append(f"{client.host}:{client.port}: {type(exc).__name__}: {_detail(exc)}")
                continue
            except Etcd3Exception as exc:   # etcd answered, and refused
                raise ClusterRefusedError(f"etcd at {client.host}:{client.port} refused {path}: {_detail(exc)}") from None
            except (OSError, ValueError) as exc:   # a reset connection, a body that is not JSON
                errors.append(f"{client.host}:{client.port}: {exc}")
                continue
            if isinstance(out, dict) and "error" in out and len(out) <= 3:   # an error in a 200 body
                raise ClusterRefusedError(f"etcd at {client.host}:{client.port} refused {path}: {out.get('error')}")
            with self._lock:
                self._first = k
            return out
        raise ClusterUnavailableError(f"etcd did not answer {path} ({'; '.join(errors)})")

    # -- keys ---------------------------------------------------------------------------
    def get_prefix(self, prefix: bytes, keys_only: bool = False) -> tuple[int, list[KeyValue]]:
        """Every key under ``prefix`` (without values if ``keys_only``), and the revision
        they were read at."""
        body: dict[str, Any] = {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}
        if keys_only:
            body["keys_only"] = True
        rep = self._call("/kv/range", body)
        revision = int(rep.get("header", {}).get("revision", 0))
        return revision, [_kv(kv) for kv in rep.get("kvs", [])]

    def get_prefix_paged(self, prefix: bytes, keys_only: bool = False,
                         page: int = LIST_PAGE) -> tuple[int, list[KeyValue]]:
        """Every key under ``prefix``, in requests of ``page`` keys, all read at the first
        request's revision (a listing too large for one answer within the deadline); and
        that revision. A revision compacted meanwhile is a ClusterRefusedError."""
        end, start, revision, out = prefix_end(prefix), prefix, 0, []
        while True:
            body: dict[str, Any] = {"key": _b64(start), "range_end": _b64(end), "limit": str(page)}
            if keys_only:
                body["keys_only"] = True
            if revision:
                body["revision"] = str(revision)
            rep = self._call("/kv/range", body)
            if not revision:
                revision = int(rep.get("header", {}).get("revision", 0))
            kvs = [_kv(kv) for kv in rep.get("kvs", [])]
            out.extend(kvs)
            if not rep.get("more") or not kvs:
                return revision, out
            start = kvs[-1].key + b"\0"

    def get(self, key: bytes) -> KeyValue | None:
        rep = self._call("/kv/range", {"key": _b64(key)})
        kvs = rep.get("kvs", [])
        return _kv(kvs[0]) if kvs else None

    def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        """Put ``key``; the new revision."""
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        return int(self._call("/kv/put", body).get("header", {}).get("revision", 0))

    def replace(self, key: bytes, mod_revision: int, value: bytes, lease: int = 0) -> bool:
        """Put ``key`` only where it is still at ``mod_revision`` (one transaction); whether it was."""
        put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            put["lease"] = str(lease)
        rep = self._call("/kv/txn", {
            "compare": [{"key": _b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": str(mod_revision)}],
            "success": [{"request_put": put}], "failure": []})
        return bool(rep.get("succeeded", False))

    def create(self, key: bytes, value: bytes, lease: int = 0) -> bool:
        """Put ``key`` only where it does not exist (one transaction); whether it did."""
        put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            put["lease"] = str(lease)
        rep = self._call("/kv/txn", {
            "compare": [{"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": "0"}],
            "success": [{"request_put": put}], "failure": []})
        return bool(rep.get("succeeded", False))

    def write(self, puts: Sequence[tuple[bytes, bytes]] = (), deletes: Sequence[bytes] = (), lease: int = 0) -> int:
        """Delete ``deletes`` then put ``puts`` (under ``lease``) in one transaction (at most
        :data:`MAX_TXN_OPS` operations: etcd's default limit); the new revision. A lease etcd
        no longer has refuses the whole transaction (ClusterRefusedError)."""
        if len(puts) + len(deletes) > MAX_TXN_OPS:
            raise ValueError(f"an etcd transaction holds at most {MAX_TXN_OPS} operations, got "
                             f"{len(puts) + len(deletes)}")
        ops: list[dict[str, Any]] = [{"request_delete_range": {"key": _b64(k)}} for k in deletes]
        for key, value in puts:
            put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
            if lease:
                put["lease"] = str(lease)
            ops.append({"request_put": put})
        if not ops:
            return 0
        rep = self._call("/kv/txn", {"compare": [], "success": ops, "failure": []})
        return int(rep.get("header", {}).get("revision", 0))

    def count_prefix(self, prefix: bytes) -> tuple[int, int]:
        """How many keys are under ``prefix``, and the revision they were counted at."""
        rep = self._call("/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)),
                                       "count_only": True})
        return int(rep.get("count", 0) or 0), int(rep.get("header", {}).get("revision", 0))

    def db_size(self) -> int:
        """The bytes etcd's store takes in use (``dbSizeInUse``; ``dbSize`` where the server
        does not report it) on the endpoint that answers."""
        rep = self._call("/maintenance/status", {})
        return int(rep.get("dbSizeInUse") or rep.get("dbSize") or 0)

    # -- leases -------------------------------------------------------------------------
    def grant(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds; its id."""
        rep = self._call("/lease/grant", {"TTL": str(int(ttl_s)), "ID": "0"})
        lease = int(rep.get("ID", 0))
        if not lease:
            raise ClusterUnavailableError(f"etcd at {self.where} granted no lease: {rep.get('error', rep)}")
        return lease

    def keepalive(self, lease: int) -> int:
        """Renew ``lease``; its remaining TTL in seconds, or -1 when it no longer exists
        (expired or revoked: its keys are gone)."""
        rep = self._call("/lease/keepalive", {"ID": str(lease)})
        result = rep.get("result", rep)
        ttl = int(result.get("TTL", -1) or -1) if isinstance(result, dict) else -1
        return ttl if ttl > 0 else -1

    def revoke(self, lease: int) -> None:
        """End ``lease`` now: its keys are deleted (a lease already gone is fine)."""
        try:
            self._call("/lease/revoke", {"ID": str(lease)})
        except ClusterRefusedError as exc:
            if "lease not found" not in str(exc):
                raise

    # -- watches ------------------------------------------------------------------------
    def watch_prefix(self, prefix: bytes, start_revision: int, on_events: Callable[[list[Event]], None],
                     on_broken: Callable[[Exception | None], None]) -> Callable[[], None]:
        """Stream the events under ``prefix`` from ``start_revision`` on a thread; returns
        ``cancel``. ``on_broken`` is called once if the stream ends before ``cancel()``."""
        client = self._clients[self._first]
        body = {"create_request": {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)),
                                   "start_revision": str(start_revision)}}
        cancelled = threading.Event()
        holder: dict[str, Any] = {}

        def run() -> None:
            import requests

            error: Exception | None = None
            try:
                # Connect within the deadline; then wait for events as long as they take.
                resp = client.session.post(client.get_url("/watch"), json=body, stream=True,
                                           timeout=(self.timeout_s, WATCH_IDLE_S))
                holder["resp"] = resp
                if cancelled.is_set():
                    return
                if resp.status_code != 200:
                    raise ClusterUnavailableError(f"etcd refused a watch: {resp.status_code} {resp.text[:200]}")
                for line in resp.iter_lines():
                    if cancelled.is_set():
                        return
                    if not line.strip():
                        continue
                    chunk = json.loads(line)
                    if "error" in chunk:
                        raise ClusterUnavailableError(f"etcd ended a watch: {chunk['error']}")
                    result = chunk.get("result", {})
                    if result.get("canceled") or result.get("compact_revision"):
                        raise ClusterUnavailableError(f"etcd cancelled a watch ({result.get('cancel_reason', '')}"
                                                      f" compacted to {result.get('compact_revision', '-')})")
                    events = [Event(_kv(e["kv"]), e.get("type") == "DELETE") for e in result.get("events", [])]
                    if events:
                        on_events(events)
            except (requests.RequestException, OSError, ValueError, ClusterUnavailableError) as exc:
                error = exc
            except Exception as exc:   # noqa: BLE001 - a callback's failure breaks the watch, reported
                if cancelled.is_set():   # the stream closed under its reader by cancel()
                    return
                log.exception("tierkv: a watch of %r failed", prefix)
                error = exc
            if not cancelled.is_set():
                on_broken(error)

        thread = threading.Thread(target=run, name="tierkv-etcd-watch", daemon=True)
        thread.start()

        def cancel() -> None:
            cancelled.set()
            resp = holder.get("resp")
            if resp is not None:
                try:   # wake the reading thread: shut the stream's socket down
                    raw = resp.raw
                    sock = getattr(getattr(raw, "_fp", None), "fp", None)
                    sock = getattr(sock, "raw", None)
                    sock = getattr(sock, "_sock", None)
                    if sock is not None:
                        import socket
                        sock.shutdown(socket.SHUT_RDWR)
                    resp.close()
                except (OSError, AttributeError):
                    pass
            thread.join(timeout=self.timeout_s + 1)

        return cancel

    def close(self) -> None:
        for client in self._clients:
            client.session.close()


def _detail(exc: Exception) -> str:
    """What etcd (or the connection) said, from an etcd3gw exception."""
    text = getattr(exc, "detail_text", None) or str(exc) or type(exc).__name__
    try:
        parsed = json.loads(text)
        if isinstance(parsed, dict):
            text = str(parsed.get("error") or parsed.get("message") or text)
    except ValueError:
        pass
    return " ".join(str(text).split())[:300]


def _kv(kv: dict[str, Any]) -> KeyValue:
    return KeyValue(_unb64(kv.get("key")), _unb64(kv.get("value")), int(kv.get("lease", 0) or 0),
                    int(kv.get("mod_revision", 0) or 0))
