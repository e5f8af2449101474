"""Node-to-node KV page handoff: transports, their controls, and the peer server.

A node serves its DRAM tier with :class:`PeerServer`; another node reaches it with
:func:`connect` (RDMA where pyverbs and a device exist, else TCP) and reads or writes
pages by remote slot index, or wraps the connection in
:class:`tierkv.tiers.peer.PeerDramTier`. See ``docs/rdma.md``.

Modules: ``wire`` (the protocol), ``transport`` (the interface and results), ``tcp`` /
``tcp_server`` (the fallback), ``rdma`` (pyverbs, imported lazily), ``server`` (the
slot store), and the controls ``credits``, ``window``, ``mux``, ``pool``.
"""

from __future__ import annotations

import ipaddress
from typing import Literal, Self

from tierkv.errors import ConfigError, InputError
from tierkv.net.auth import Credential, ServerAuth
from tierkv.net.server import SlotStore
from tierkv.net.tcp import TcpTransport
from tierkv.net.tcp_server import ServerStats, TcpServer
from tierkv.net.transport import CallResult, LinkStats, NetConfig, PeerInfo, ReadResult, Transport, WriteResult
from tierkv.net.wire import PageMeta, WriteStatus
from tierkv.tiers.dram import DramTier

TransportKind = Literal["auto", "tcp", "rdma"]


class PeerServer:
    """Serves ``tier``'s slots on ``host:port`` (port 0: any free port; see ``address``).

    Always listens on TCP (the fallback, and the RDMA path's out-of-band exchange);
    ``rdma=True`` also registers the tier's buffer with the RDMA device on ``host``'s
    interface and accepts RDMA clients. ``store`` is the node-local API (``store``,
    ``publish``, ``forget``). Close it (or use it as a context manager) to stop.

    ``auth``: the principals it accepts (:mod:`tierkv.net.auth`); without it, any client
    is served, so it binds only a loopback address unless ``insecure=True`` says that the
    network is trusted. ``keyed``: reads must name the key of each slot (a store serving
    its own pages).
    """

    def __init__(self, tier: DramTier, host: str = "127.0.0.1", port: int = 0, config: NetConfig | None = None,
                 rdma: bool = False, workers: int = 4, accept_writes: bool = True, *,
                 auth: ServerAuth | None = None, keyed: bool = False, insecure: bool = False) -> None:
        self.config = config or NetConfig()
        if auth is None and not insecure and not is_loopback(host):
            raise ConfigError(f"a peer server on {host} without credentials would serve anyone who can reach it; "
                              "give it credentials ([peers] secret_file), bind a loopback address, or pass "
                              "insecure=True on a network you trust")
        self.store = SlotStore(tier, accept_writes, keyed)
        self.rdma = None
        if rdma:
            try:
                from tierkv.net.rdma_server import RdmaServer
            except ImportError as exc:
                raise ConfigError(f"PeerServer(rdma=True) needs pyverbs (rdma-core's Python bindings): {exc}; "
                                  "use rdma=False for TCP") from None

            self.rdma = RdmaServer(self.store, host, self.config)
            accept = self.rdma.accept
            self.store.methods["rdma-connect"] = lambda body, scope: accept(body)
        self.tcp = TcpServer(self.store, host, port, self.config, workers=workers, auth=auth)
        self.address = self.tcp.address

    def stats(self) -> ServerStats:
        return self.tcp.stats()

    def close(self) -> None:
        self.tcp.close()
        if self.rdma is not None:
            self.rdma.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is this machine's loopback only."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def rdma_available() -> bool:
    """Whether pyverbs imports and lists at least one RDMA device."""
    try:
        from tierkv.net.rdma import devices
    except ImportError:
        return False
    return bool(devices())


def connect(host: str, port: int, kind: TransportKind = "auto", config: NetConfig | None = None) -> Transport:
    """A transport to the :class:`PeerServer` at ``host:port``. ``auto``: RDMA when
    :func:`rdma_available`, else TCP. Raises TierUnavailableError when the peer cannot be reached."""
    if kind not in ("auto", "tcp", "rdma"):
        raise InputError(f"transport kind must be auto, tcp or rdma, got {kind!r}")
    if kind == "rdma" or (kind == "auto" and rdma_available()):
        from tierkv.net.rdma_client import RdmaTransport

        return RdmaTransport(host, port, config)
    return TcpTransport(host, port, config)


__all__ = ["CallResult", "Credential", "LinkStats", "NetConfig", "PageMeta", "PeerInfo", "PeerServer", "ReadResult",
           "ServerAuth", "ServerStats", "SlotStore", "TcpTransport", "Transport", "WriteResult", "WriteStatus", "connect",
           "is_loopback", "rdma_available"]
