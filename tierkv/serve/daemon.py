"""The node service: one store, many engine processes (``tierkv serve``).

:class:`NodeService` opens the store (its tiers, index and peers, as ``Store.open``
does) and serves it on a Unix socket (:mod:`tierkv.serve.protocol`). Each connection
gets a thread; the store's own lock orders their calls, so every call means what it
means in-process. A connection's tokens are turned into keys here, never taken from
the client.

Page bytes move between the store's tiers and shared-memory segments the client
registered (a ``memfd`` whose descriptor came with the request): the daemon copies a
put's rows straight from the segment into their tier, and a get's pages straight into
it, so a client whose page buffer is such a segment (``RemoteStore.page_buffer``) pays
the one copy an in-process store pays. The store's own tiers are never mapped by a
client. A segment must be sealed against shrinking (``F_SEAL_SHRINK``): a client that
truncated one under the daemon's mapping would otherwise fault the daemon.

Bounds: at most ``max_clients`` connections (others are told ``StoreBusyError``), at
most ``MAX_SEGMENTS`` segments per connection (:mod:`tierkv.serve.segments`; a client
gives one back with ``UNREGISTER``), a request's body within
``body_timeout_s`` once its header arrived, frames within ``protocol.MAX_BODY``. A
client that breaks the framing loses its connection; nothing it sent half-way is
applied (a put is applied only once its whole request arrived, and its rows were in
the segment before it was sent).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import pwd
import socket
import stat
import struct
import threading
import time
from collections.abc import Iterator
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tierkv import __version__
from tierkv.config import ServeConfig, StoreConfig
from tierkv.errors import AccessDeniedError, ConfigError, InputError, StoreBusyError, TierKVError
from tierkv.layout import PageOrder
from tierkv.serve import protocol as P
from tierkv.serve.access import Access, Grant
from tierkv.serve.segments import SegmentBudget, Segments
from tierkv.store import landed, lossy_pages
from tierkv.store.api import LookupResult, Store
from tierkv.store.opening import SERVED_FILE
from tierkv.tiers.hugepages import shmem_huge_pages

log = logging.getLogger(__name__)

#: Clients listed in a status reply (the oldest connections).
STATUS_CLIENTS = 1000
#: How long a prefetch request may run before its connection gets an error (the
#: prefetch goes on in the store).
PREFETCH_WAIT_S = 300.0


class NodeService:
    """Serve the store ``config`` describes on a Unix socket.

    The socket, its mode, the client limit, the request deadline and the tenants each
    user may use come from ``config.serve`` (:class:`~tierkv.config.ServeConfig`; its
    defaults where absent); ``socket_path``, ``mode`` (permission bits: 0o600 only the
    daemon's user may connect, 0o660 its group too), ``max_clients`` and
    ``body_timeout_s`` override them. Call :meth:`serve_forever` (or :meth:`start` for a
    thread), then :meth:`close`.
    """

    def __init__(self, config: StoreConfig, socket_path: str | os.PathLike[str] | None = None, *,
                 mode: int | None = None, max_clients: int | None = None,
                 body_timeout_s: float | None = None) -> None:
        sc = config.serve if config.serve is not None else ServeConfig()
        mode = sc.mode_bits if mode is None else mode
        max_clients = sc.max_clients if max_clients is None else max_clients
        body_timeout_s = sc.request_timeout_s if body_timeout_s is None else body_timeout_s
        if socket_path is None:
            socket_path = config.socket_path()
        self._access = Access(sc.tenants)
        if not 0 <= mode <= 0o777:
            raise ConfigError(f"serve: socket mode must be permission bits such as 0o600, got {mode:#o}")
        if max_clients < 1:
            raise ConfigError(f"serve: max_clients must be at least 1, got {max_clients}")
        self.path = Path(socket_path)
        if len(os.fsencode(self.path)) > 107:
            raise ConfigError(f"serve: socket path {self.path} is longer than the 107 bytes a Unix socket allows; "
                              "pick a shorter one")
        self.mode = mode
        self.max_clients = max_clients
        self.body_timeout_s = body_timeout_s
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._info: dict[socket.socket, _Client] = {}
        self._sessions: dict[tuple[int, str], list[int]] = {}   # (pid, client) -> [pin owner, connections]
        self._segments = SegmentBudget(max_clients)   # client segments mapped, over all connections
        self._lent_fraction = sc.max_lent_fraction    # of the DRAM tier's rows, per connection
        self.started = time.time()
        self.requests = 0
        self._metrics: Any = None
        self._thread: threading.Thread | None = None
        self.store = Store.open(config)
        self._served = Path(config.path) / SERVED_FILE
        try:
            self._listener = self._bind()
            fd = os.open(self._served, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:   # a second open of the store says where to connect
                f.write(f"{os.getpid()}\n{self.path}\n")
        except BaseException:
            self.store.close()
            raise
        self._hello = self._describe()
        self._cluster: Any = None
        if config.cluster is not None:   # register in the cluster, follow it (docs/cluster.md)
            try:
                from tierkv.cluster.node import ClusterNode

                self._cluster = ClusterNode(self.store, config)
            except BaseException:
                self._listener.close()
                for made in (self.path, self._served):
                    made.unlink(missing_ok=True)
                self.store.close()
                raise

    # -- the socket -------------------------------------------------------------------
    def _bind(self) -> socket.socket:
        if self.path.exists() or self.path.is_symlink():
            st = self.path.lstat()
            if not stat.S_ISSOCK(st.st_mode):
                raise ConfigError(f"serve: {self.path} exists and is not a socket; remove it or pick another path")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(os.fspath(self.path))
            except OSError:
                self.path.unlink()   # a socket no daemon listens on: left by one killed
            else:
                raise StoreBusyError(f"serve: a daemon already listens on {self.path}")
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o777 & ~self.mode)   # no moment where the socket is wider than asked
        try:
            sock.bind(os.fspath(self.path))
        except OSError as exc:
            sock.close()
            raise ConfigError(f"serve: cannot listen on {self.path}: {exc.strerror}") from None
        finally:
            os.umask(old)
        os.chmod(self.path, self.mode)
        sock.listen(max(16, self.max_clients))
        return sock

    def _describe(self) -> dict[str, Any]:
        """What HELLO tells a client (with, per connection, whether it may use every tenant)."""
        lay = self.store.layout
        layout: dict[str, Any] = {"num_layers": lay.num_layers, "num_kv_heads": lay.num_kv_heads,
                                  "head_dim": lay.head_dim, "dtype": lay.dtype.value,
                                  "tokens_per_page": lay.tokens_per_page, "kind": lay.kind.value}
        if lay.page_order is not PageOrder.STANDARD:   # absent otherwise: a client without the field still reads it
            layout["page_order"] = lay.page_order.value
        return {
            "version": P.VERSION, "pid": os.getpid(), "model_id": self.store.config.model_id,
            "layout": layout,
            "page_bytes": lay.page_bytes, "store": str(self.store.config.path),
        }

    # -- running ----------------------------------------------------------------------
    def start(self) -> NodeService:
        """Serve on a background thread; returns self."""
        self._thread = threading.Thread(target=self.serve_forever, name="tierkv-serve", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Accept connections until :meth:`close`."""
        refused = 0.0
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError as exc:
                if self._closed.is_set():
                    return
                # Out of file descriptors or memory: the daemon keeps serving who it has and
                # accepts again shortly; never lets the accept loop die.
                if time.monotonic() - refused > 60:
                    log.warning("accepting a connection failed (%s); retrying", exc)
                    refused = time.monotonic()
                time.sleep(0.2)
                continue
            with self._lock:
                full = len(self._conns) >= self.max_clients
                if not full and not self._closed.is_set():
                    t = threading.Thread(target=self._serve_conn, args=(conn,), name="tierkv-serve-conn",
                                         daemon=True)
                    self._conns[conn] = t
                    try:
                        t.start()
                        continue
                    except RuntimeError as exc:   # no thread to be had (memory): refuse this one
                        del self._conns[conn]
                        log.warning("could not start a thread for a connection: %s", exc)
            if full:
                try:
                    P.send_frame(conn, P.Op.HELLO, P.error_body(StoreBusyError(
                        f"the tierkv daemon at {self.path} serves {self.max_clients} clients already")), P.Status.ERROR)
                except OSError:
                    pass
            conn.close()

    @property
    def clients(self) -> int:
        with self._lock:
            return len(self._conns)

    @property
    def mapped_segments(self) -> int:
        """Client segments mapped now, over every connection."""
        return self._segments.mapped

    def status(self, clients: bool = True) -> dict[str, Any]:
        """The daemon, its connections (``clients``: with their pids and users) and the
        store's stats, as ``tierkv status`` shows them."""
        now = time.time()
        with self._lock:
            infos = list(self._info.values())
            served = self.requests + sum(i.requests for i in infos)
        out: dict[str, Any] = {
            "pid": os.getpid(), "socket": str(self.path), "store": str(self.store.config.path),
            "model_id": self.store.config.model_id, "version": __version__, "protocol": P.VERSION,
            "uptime_s": round(now - self.started, 3), "connections": len(infos), "requests": served,
            "access": "open" if self._access.open else "by user ([serve] tenants)",
            "shmem_huge_pages": shmem_huge_pages(),
            "stats": self.store.stats().to_dict(),
        }
        if self._cluster is not None:
            out["cluster"] = self._cluster.status()
        if clients:   # the oldest STATUS_CLIENTS, so that the reply stays a small frame
            out["clients"] = [{"pid": i.pid, "uid": i.uid, "user": _user(i.uid), "connected_s": round(now - i.since, 3),
                               "requests": i.requests}
                              for i in sorted(infos, key=lambda i: i.since)[:STATUS_CLIENTS]]
        return out

    def start_metrics(self, addr: str, port: int) -> int:
        """Serve Prometheus metrics (the store's, and the daemon's clients and requests) on
        ``http://addr:port/metrics`` until :meth:`close`; returns the port (0 picks one)."""
        try:
            from prometheus_client import CollectorRegistry
            from prometheus_client.exposition import start_http_server
        except ImportError:
            raise ConfigError("--metrics needs prometheus_client: pip install 'tierkv[metrics]'") from None
        from tierkv.store.metrics import StoreCollector

        registry = CollectorRegistry()
        registry.register(StoreCollector(self.store))  # type: ignore[arg-type]
        registry.register(_ServiceCollector(self))  # type: ignore[arg-type]
        try:
            self._metrics, _ = start_http_server(port, addr=addr, registry=registry)
        except OSError as exc:
            raise ConfigError(f"--metrics {addr}:{port}: {exc.strerror or exc}") from None
        return int(self._metrics.server_address[1])

    def close(self) -> None:
        """Stop accepting, end every connection, close the store (which writes back what
        it holds in volatile tiers, as an in-process close does) and remove the socket."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._cluster is not None:   # leave the cluster first: nobody is sent here any more
            self._cluster.close()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            conns = dict(self._conns)
        for c in conns:   # idle connections wake and end; one mid-request finishes and answers first
            try:
                c.shutdown(socket.SHUT_RD)
            except OSError:
                pass
        for t in conns.values():
            t.join()
        if self._metrics is not None:
            self._metrics.shutdown()
            self._metrics.server_close()
        for done in (self.path, self._served):
            try:
                done.unlink()
            except FileNotFoundError:
                pass
        self.store.close()

    def __enter__(self) -> NodeService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one connection ---------------------------------------------------------------
    def _serve_conn(self, conn: socket.socket) -> None:
        segments = Segments(self._segments)
        info: _Client | None = None
        try:
            try:
                grant = self._access.grant(conn)
            except TierKVError as exc:
                log.warning("refused a connection: %s", exc)
                P.send_frame(conn, P.Op.HELLO, P.error_body(exc), P.Status.ERROR)
                return
            info = _Client(grant.pid, grant.uid, time.time(), sock=conn)
            with self._lock:
                self._info[conn] = info
            while not self._closed.is_set():
                try:
                    op, _status, body, fds = P.recv_frame(conn, body_timeout=self.body_timeout_s, want_fds=True)
                except EOFError:
                    return
                except (P.ProtocolError, OSError) as exc:
                    if not self._closed.is_set():
                        log.info("a client connection ended: %s", exc)
                    return
                try:
                    info.requests += 1
                    reply = self._handle(op, body, fds, segments, grant, info)
                except P.ProtocolError as exc:
                    log.info("a client broke the protocol, closing its connection: %s", exc)
                    return
                except TierKVError as exc:
                    P.send_frame(conn, op, P.error_body(exc), P.Status.ERROR)
                    continue
                except Exception as exc:  # noqa: BLE001 - the client gets the error, the daemon goes on
                    log.exception("a %s request failed", P.Op(op).name if op in P.Op._value2member_map_ else op)
                    P.send_frame(conn, op, P.error_body(TierKVError(f"the daemon failed this request: {exc!r}")),
                                 P.Status.ERROR)
                    continue
                finally:
                    for fd in fds:
                        try:
                            os.close(fd)
                        except OSError:
                            pass
                if isinstance(reply, tuple):   # a reply that carries descriptors
                    P.send_frame(conn, op, reply[0], fds=reply[1])
                else:
                    P.send_frame(conn, op, reply)
        except OSError as exc:
            if not self._closed.is_set():
                log.info("a client connection ended: %s", exc)
        finally:
            try:
                segments.close()
                if info is not None:
                    for token in info.lends:   # the rows it borrowed go back with it
                        try:
                            self.store.end_lend(token)
                        except TierKVError as exc:   # the pins below are released whatever happens here
                            log.warning("ending lend %d of a closed connection: %s", token, exc)
                    info.lends.clear()
                    self._release_pins(info)
            finally:   # whatever failed above, the connection is forgotten and closed
                with self._lock:
                    self._conns.pop(conn, None)
                    gone = self._info.pop(conn, None)
                    if gone is not None:
                        self.requests += gone.requests
                conn.close()

    def _handle(self, op: int, body: memoryview, fds: list[int], segments: Segments,
                grant: Grant, info: _Client) -> bytes | tuple[bytes, tuple[int, ...]]:
        if fds and op != P.Op.SEGMENT:
            raise P.ProtocolError(f"file descriptors sent with op {op}")
        s = self.store
        if op == P.Op.HELLO:
            try:
                hello = json.loads(bytes(body))
            except ValueError:
                raise P.ProtocolError("HELLO is not JSON") from None
            if not isinstance(hello, dict) or hello.get("version") != P.VERSION:
                got = hello.get("version") if isinstance(hello, dict) else None
                raise ConfigError(f"this tierkv daemon speaks protocol version {P.VERSION}, the client {got!r}: "
                                  "run the same tierkv version on both sides")
            client = hello.get("client")
            if isinstance(client, str) and 0 < len(client) <= 64 and info.requests == 1:
                self._join(info, client)
            return json.dumps(self._hello).encode()
        if op == P.Op.SEGMENT:
            return segments.register(body, fds)
        if op == P.Op.UNREGISTER:
            return segments.unregister(body)
        if op == P.Op.LOOKUP:
            flags, budget = _unpack(P.LOOKUP_REQ, body)
            if flags & P.FLAG_STREAMED:
                return self._streamed_lookup(s, flags, budget, body, segments, grant, info)
            # read in place: a client that changes its tokens meanwhile misleads only itself
            salt, tokens = self._tokens(body, P.LOOKUP_REQ.size, segments, grant, copy=False)
            found = s.lookup(tokens, salt, count=bool(flags & P.FLAG_COUNT), accept=_accept(flags),
                             accept_lossy=budget or None)
            del tokens
            return _lookup_reply(found)
        if op == P.Op.GET:
            seg, off, rows, requested, flags, budget = _unpack(P.GET_REQ, body)
            salt, tokens = self._tokens(body, P.GET_REQ.size, segments, grant)
            out = segments.rows(seg, off, rows, s.layout.page_bytes)
            if budget:   # lossy pages go to the client as stored: it decodes them
                lossy_pages.check_budget(budget, "get(accept_lossy=...)")
                if flags & P.FLAG_DERIVED:
                    raise InputError("get: accept='derived' and accept_lossy= cannot be asked together")
                g = lossy_pages.get_lossy_raw(s, tokens, out, salt, s.get(
                    tokens, out, salt, requested=None if requested < 0 else requested), budget)
            else:
                g = s.get(tokens, out, salt, requested=None if requested < 0 else requested, accept=_accept(flags))
            del out
            return P.GET_REP.pack(g.pages, g.tokens, g.derived, g.lossy) + bytes(k.rank for k in g.tiers)
        if op == P.Op.GET_LAYERED:   # layer by layer, each announced in the client's landing record
            seg, off, rows, requested, lseg, loff = _unpack(P.GET_LAYERED_REQ, body)
            salt, tokens = self._tokens(body, P.GET_LAYERED_REQ.size, segments, grant)
            out = segments.rows(seg, off, rows, s.layout.page_bytes)
            record = segments.words(lseg, loff, landed.WORDS)
            g = s.get(tokens, out, salt, requested=None if requested < 0 else requested, landed=record)
            del out, record
            return P.GET_REP.pack(g.pages, g.tokens, g.derived, g.lossy) + bytes(k.rank for k in g.tiers)
        if op == P.Op.SPLICE:
            return self._splice(s, body, segments, grant)
        if op == P.Op.ORIGINS:
            skip, limit = _unpack(P.ORIGINS_REQ, body)
            salt, tokens = self._tokens(body, P.ORIGINS_REQ.size, segments, grant)
            origins = s.origins(tokens, salt)
            part = origins[skip:skip + min(limit, P.ORIGINS_PER_REPLY)]
            return json.dumps({"total": len(origins),
                               "origins": [o.to_dict() if o is not None else None for o in part]}).encode()
        if op in (P.Op.DRAM_POOL, P.Op.LEND, P.Op.END_LEND):
            return self._lending(op, body, segments, grant, info)
        if op == P.Op.PUT:
            seg, off, rows, unfilled, announce, budget = _unpack(P.PUT_REQ, body)
            salt, tokens = self._tokens(body, P.PUT_REQ.size, segments, grant)
            src = segments.rows(seg, off, rows, s.layout.page_bytes)
            if budget:   # rows its client coded lossy (put_lossy): copied, so what is checked is what is stored
                src = np.array(src)
                lossy_pages.check_rows(s.layout, src, lossy_pages.check_budget(budget, "put_lossy"), "put_lossy")
                r = lossy_pages.put_coded(s, tokens, src, salt, budget)
            else:
                r = s.put(tokens, src, salt, announce=bool(announce), unfilled=unfilled)
            del src
            return P.PUT_REP.pack(r.stored, r.already_present, r.dropped)
        if op in (P.Op.PREFETCH, P.Op.PIN, P.Op.UNPIN):
            salt, tokens = self._tokens(body, 0, segments, grant)
            if op == P.Op.PIN:   # this connection's own: released when it ends, if not before
                return P.COUNT.pack(s.pin(tokens, salt, owner=info.id))
            if op == P.Op.UNPIN:
                return P.COUNT.pack(s.unpin(tokens, salt, owner=info.id))
            try:
                return P.COUNT.pack(s.prefetch(tokens, salt).result(timeout=PREFETCH_WAIT_S))
            except FutureTimeout:
                raise TierKVError(f"prefetch did not finish within {PREFETCH_WAIT_S:.0f} s") from None
        if op == P.Op.STATS:
            return json.dumps(s.stats().to_dict()).encode()
        if op == P.Op.FLUSH:
            s.flush()
            return b""
        if op == P.Op.STATUS:
            return json.dumps(self.status(clients=grant.salts is None)).encode()
        raise P.ProtocolError(f"unknown op {op}")

    def _lending(self, op: int, body: memoryview, segments: Segments, grant: Grant,
                 info: _Client) -> bytes | tuple[bytes, tuple[int, ...]]:
        """DRAM_POOL, LEND, END_LEND: pages read by the client straight out of the DRAM
        tier's memory (``Store.lend``), for connections that may use every tenant: the
        mapping shows every tenant's pages."""
        s = self.store
        if grant.salts is not None:
            raise AccessDeniedError("the DRAM pool holds every tenant's pages: lending needs a connection whose user "
                                    "may use every tenant; use get")
        if op == P.Op.DRAM_POOL:
            fd, slots, slot_bytes, pool = s.lend_pool()
            if fd < 0:
                raise TierKVError("this store's DRAM tier is not in shared memory (none, page-locked, or not on "
                                  "top): nothing to lend; use get")
            return P.POOL_REP.pack(slots, slot_bytes, pool), (fd,)
        if op == P.Op.LEND:
            want, requested, whole = _unpack(P.LEND_REQ, body)
            salt, tokens = self._tokens(body, P.LEND_REQ.size, segments, grant)
            _, slots, _, pool = s.lend_pool()
            held = sum(info.lends.values())
            room = max(1, int(slots * self._lent_fraction)) - held if slots else want
            if want > room and (whole or room <= 0):   # nothing lent, nothing counted: the client gets
                log.info("a connection (pid %d) holds %d lent DRAM rows; a lend of %d more is refused "
                         "(serve.max_lent_fraction %.2f)", info.pid, held, want, self._lent_fraction)
                return P.LEND_REP.pack(0, 0, -1, pool)
            lent = s.lend(tokens, salt, want=min(want, room), requested=want if requested < 0 else requested,
                          whole=bool(whole))
            if lent.token >= 0:
                info.lends[lent.token] = lent.pages
            return (P.LEND_REP.pack(lent.pages, lent.tokens, lent.token, lent.pool)
                    + np.asarray(lent.slots, "<u4").tobytes())
        (token,) = _unpack(P.END_LEND_REQ, body)
        if token >= 0:
            if token not in info.lends:
                raise InputError(f"end_lend: lend {token} is not open on this connection (a lend ends on the "
                                 "thread that took it)")
            del info.lends[token]
            s.end_lend(token)
        return b""

    def _join(self, info: _Client, client: str) -> None:
        """The connection is one of the client (a ``RemoteStore``: a connection per thread)
        that HELLO named: its pins are the client's, as an in-process store's are its
        caller's, and go when the client's last connection ends. Named per process (the
        kernel's pid), so no other process can take or release them."""
        with self._lock:
            session = self._sessions.setdefault((info.pid, client), [info.id, 0])
            session[1] += 1
            info.id, info.session = session[0], (info.pid, client)

    def _release_pins(self, info: _Client) -> None:
        """The pins a connection's client took and did not release, and only those:
        released once its last connection ends (a client that exits or is killed must not
        hold pages for good)."""
        key = info.session
        if key is not None:
            with self._lock:
                session = self._sessions[key]
                session[1] -= 1
                if session[1]:
                    return
                del self._sessions[key]
        try:
            self.store.release_pins(info.id)
        except TierKVError:   # the store closed meanwhile: its pins are gone with it
            pass

    def _splice(self, s: Store, body: memoryview, segments: Segments, grant: Grant) -> bytes:
        """A client's :meth:`Store.splice`, the model's rotary embedding sent with it."""
        from tierkv.splice.rope import Rope

        start, end, head_dim, nfreq, interleaved, nname = _unpack(P.SPLICE_REQ, body)
        at = P.SPLICE_REQ.size
        if len(body) < at + 4 * nfreq + nname + P.SPLICE_LEN.size:
            raise InputError("a splice request ends before its rotary embedding")
        inv = np.frombuffer(body, "<f4", nfreq, at).copy()
        at += 4 * nfreq
        rope_type = bytes(body[at:at + nname]).decode(errors="replace")
        at += nname
        (nrep,) = P.SPLICE_LEN.unpack_from(body, at)
        at += P.SPLICE_LEN.size
        if len(body) < at + 4 * nrep:
            raise InputError("a splice request ends before its replacement's tokens")
        replacement = np.frombuffer(body, "<u4", nrep, at).copy()
        salt, tokens = self._tokens(body, at + 4 * nrep, segments, grant)
        rope = Rope(inv, head_dim, "interleaved" if interleaved else "half", rope_type)
        r = s.splice(tokens, start, end, replacement, rope=rope, tenant=salt)
        return P.SPLICE_REP.pack(r.prefill_from, r.prefill_to, r.first_derived, r.derived, r.stored, r.delta)

    def _streamed_lookup(self, s: Store, flags: int, budget: float, body: memoryview, segments: Segments,
                         grant: Grant, info: _Client) -> bytes:
        """A LOOKUP with ``FLAG_STREAMED``: its ids lie in a segment, where the client is
        still writing them (a long prompt, narrowed to uint32 after the request went, so
        that the narrowing overlaps the request's way here); the lookup hashes each
        stretch once the client's progress word says its ids are in place."""
        (word_at,) = _unpack(P.STREAM_REQ, body[P.LOOKUP_REQ.size:])
        salt, inline, ref = P.split_token_body(body, P.LOOKUP_REQ.size + P.STREAM_REQ.size)
        grant.check(salt)
        if ref is None:
            raise P.ProtocolError("a streamed lookup's tokens must lie in a segment")
        seg, off, count = ref
        if off < word_at + 16 and word_at < off + 4 * count:
            raise InputError(f"a streamed lookup's ids (bytes {off}-{off + 4 * count} of its segment) overlap "
                             f"its progress words (bytes {word_at}-{word_at + 16})")
        tokens = segments.tokens(seg, off, count, copy=False)   # read in place, as any lookup's
        words = segments.words(seg, word_at, 2)
        landed.publish(words, 1, 1)   # taken up: the client may poll for the reply now
        ready = _Arriving(words[:1], count, info.sock, self.body_timeout_s)
        found = s._lookup_arriving(tokens, salt, ready, count=bool(flags & P.FLAG_COUNT), accept=_accept(flags),
                                   accept_lossy=budget or None)
        del tokens, ready, words
        return _lookup_reply(found)

    def _tokens(self, body: memoryview, at: int, segments: Segments, grant: Grant,
                copy: bool = True) -> tuple[bytes, np.ndarray]:
        """The salt (one the connection's user may use) and tokens of a token op: inline,
        or copied out of a segment (so the client cannot change them while the store
        reads them; ``copy`` False: a view of the segment, for reads only)."""
        salt, inline, ref = P.split_token_body(body, at)
        grant.check(salt)
        if inline is not None:
            return salt, np.frombuffer(inline, dtype="<u4")
        assert ref is not None
        return salt, segments.tokens(*ref, copy=copy)


_client_ids = itertools.count(1)


@dataclass
class _Client:
    pid: int
    uid: int
    since: float
    requests: int = 0
    id: int = field(default_factory=lambda: next(_client_ids))   # owns the pins this connection takes
    session: tuple[int, str] | None = None   # (pid, client) of the client it belongs to, if HELLO named one
    lends: dict[int, int] = field(default_factory=dict)   # Store.lend tokens not ended -> pages lent
    sock: socket.socket | None = None   # its connection


#: How long a streamed lookup polls its client's progress word, in all, before it sleeps
#: between looks (the client narrows a 128K-token prompt's ids in tens of microseconds).
ARRIVING_SPIN_S = 0.0005


class _Arriving:
    """``ready(n)`` of a streamed lookup: returns once the client's progress word counts
    ``n`` of its ``total`` ids. Polls (yielding the GIL to the daemon's other threads
    each time) for :data:`ARRIVING_SPIN_S` in all, then sleeps between looks; InputError
    where the client abandoned the lookup (an id out of range), ProtocolError (the
    connection is closed) where it closed its socket, wrote a count past its ids or has
    not written the ids a stretch needs by the request deadline, counted from the lookup's
    start (not each stretch's)."""

    def __init__(self, word: np.ndarray, total: int, sock: socket.socket | None, timeout_s: float) -> None:
        self.word, self.total, self.sock, self.timeout_s = word, total, sock, timeout_s
        self.start = time.monotonic()
        self.spun = 0.0   # seconds polled so far, all stretches together

    def __call__(self, n: int) -> None:
        pause = 0.0
        while True:
            got = landed.read(self.word, 0)
            if got == P.STREAM_ABANDONED:
                raise InputError("the client found a token id outside [0, 2**32) while it wrote the ids: "
                                 "lookup abandoned")
            if got > self.total:
                raise P.ProtocolError(f"a streamed lookup's progress word counts {got} of its {self.total} ids")
            if got >= n:
                return
            now = time.monotonic()
            if now - self.start > self.timeout_s:
                raise P.ProtocolError(f"the client wrote {got} of the {n} ids its lookup needs in "
                                      f"{self.timeout_s:g} s")
            if self.spun < ARRIVING_SPIN_S:
                time.sleep(0)   # lets the daemon's other threads run
                self.spun += time.monotonic() - now
                continue
            if self.sock is not None and _closed(self.sock):
                raise P.ProtocolError("the client closed its connection while it wrote a lookup's ids")
            pause = min(2 * pause or 50e-6, 1e-3)
            time.sleep(pause)


def _closed(sock: socket.socket) -> bool:
    """Whether the peer of ``sock`` closed it (nothing more will come). Does not wait (a
    socket with a timeout would wait for data first, whatever the flags)."""
    timeout = sock.gettimeout()
    sock.setblocking(False)
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True
    finally:
        sock.settimeout(timeout)


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


class _ServiceCollector:
    """The daemon's own metrics: connections now, requests served."""

    def __init__(self, service: NodeService) -> None:
        self._service = service

    def collect(self) -> Iterator[object]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        st = self._service.status(clients=False)
        yield GaugeMetricFamily("tierkv_serve_connections", "Client connections open now", value=st["connections"])
        yield CounterMetricFamily("tierkv_serve_requests", "Requests served since start", value=st["requests"])
        yield GaugeMetricFamily("tierkv_serve_uptime_seconds", "Seconds since the daemon started",
                                value=st["uptime_s"])


def _unpack(fmt: struct.Struct, body: memoryview) -> tuple[int, ...]:
    if len(body) < fmt.size:
        raise P.ProtocolError(f"a request of {len(body)} bytes is shorter than its {fmt.size}-byte header")
    return fmt.unpack_from(body)


def _accept(flags: int) -> str:
    return "derived" if flags & P.FLAG_DERIVED else "exact"


def _lookup_reply(found: LookupResult) -> bytes:
    return P.LOOKUP_REP.pack(found.cached_pages, found.cached_tokens, found.total_pages, found.derived,
                             found.lossy) + \
        found.tier_ranks
