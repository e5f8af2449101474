"""Store configuration: frozen dataclasses per concern, loaded from TOML.

``load_config(path)`` reads files like ``configs/default.toml``; sizes accept
``"64GiB"``. Relative tier paths resolve against the store directory. Called by the
API (``Store.open``) and the CLI.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

from tierkv.codec.auto import CodecMode
from tierkv.errors import ConfigError, TierKVError
from tierkv.layout import KVLayout
from tierkv.policy import DEFAULT_POLICY, POLICY_NAMES
from tierkv.tiers.aligned import ALIGN, MAX_PAGE_BLOCKS
from tierkv.units import parse_size

STORE_POLICIES = POLICY_NAMES

#: The longest timeout or interval any setting takes (about 11.6 days): past it a number
#: is a typo, and ``inf`` would overflow the waits it ends up in.
MAX_SECONDS = 1e6
#: The largest bandwidth a tier may declare, in GB/s.
MAX_GBPS = 1e6
_C_INT_MAX = (1 << 31) - 1  # the kernel's connect options are C ints
#: When a page on a persistent tier is durable: when its group commit's window has run
#: ("window", what the configs in ``configs/`` set for serving), or before ``put`` returns
#: ("put"). "window" is the default: a serving engine's puts should not wait for the device
#: (docs/design.md); a caller that needs a barrier calls ``Store.flush()``.
DURABILITY_MODES = ("window", "put")
DEFAULT_DURABILITY = "window"
#: Group commit: a window closes this long after its first page ... (docs/design.md)
DEFAULT_COMMIT_WINDOW_S = 0.05
#: ... or as soon as this many pages (index records or deletes) wait in it.
DEFAULT_COMMIT_WINDOW_PAGES = 1024


# Each field is checked for its type as well as its range: TOML ``"false"`` is a string,
# and a string (or any object) is truthy, so an unchecked boolean does the opposite.

def _check_bool(value: object, what: str) -> None:
    if not isinstance(value, bool):
        kind = f" (a {type(value).__name__}, not a boolean)" if value is not None else ""
        raise ConfigError(f"{what} must be true or false, got {value!r}{kind}")


def _check_int(value: object, what: str, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{what} must be an integer in [{low}, {high}], got {value!r}")


def _check_number(value: object, what: str, unit: str, low: float, high: float, *, low_open: bool = False) -> None:
    """A finite int or float (never a bool) in ``[low, high]``, or ``(low, high]`` if ``low_open``."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) \
        and (value > low if low_open else value >= low) and value <= high
    if not ok:
        raise ConfigError(f"{what} must be a finite number of {unit} in {'(' if low_open else '['}{low:g}, "
                          f"{high:g}], got {value!r}")


def _check_str(value: object, what: str, *, optional: bool = True, path: bool = False) -> None:
    """A string (or None if ``optional``); a ``path`` is non-empty and has no NUL byte."""
    if value is None and optional:
        return
    if not isinstance(value, str):
        raise ConfigError(f"{what} must be a string{' or absent' if optional else ''}, got {value!r}")
    if path and (not value or "\0" in value):
        raise ConfigError(f"{what} must be a non-empty path without NUL bytes, got {value!r}")


def _check_codec(cfg: NvmeConfig | NvmeofConfig, tier: str) -> None:
    """Validate and normalise a tier's ``codec``, ``bandwidth_gbps``, ``o_direct``,
    ``io_threads``, ``lossy_bits`` and ``lossy_calibration``."""
    object.__setattr__(cfg, "codec", CodecMode.parse(cfg.codec).value)
    bits = cfg.lossy_bits
    if isinstance(bits, bool) or not isinstance(bits, (int, float)) or not (bits == 0 or 1 <= bits < 16):
        raise ConfigError(f"{tier}.lossy_bits must be a finite number of bits an element: 0 (exact pages), or at "
                          f"least 1 and under 16, got {bits!r}")
    if bits and cfg.codec == CodecMode.NONE.value:
        raise ConfigError(f"{tier}.lossy_bits needs codec = \"lossless\" or \"auto\": the tier stores a "
                          "lossy page's blob alone in 4 KiB blocks, which only a coding tier does")
    _check_str(cfg.lossy_calibration, f"{tier}.lossy_calibration", path=True)
    if cfg.lossy_calibration is not None and not cfg.lossy_bits:
        raise ConfigError(f"{tier}.lossy_calibration is for a lossy tier: set {tier}.lossy_bits too")
    _check_number(cfg.bandwidth_gbps, f"{tier}.bandwidth_gbps", "GB/s (0: measure)", 0, MAX_GBPS)
    _check_bool(cfg.o_direct, f"{tier}.o_direct")
    _check_int(cfg.io_threads, f"{tier}.io_threads", 1, 256)


@dataclass(frozen=True)
class HbmConfig:
    """The HBM tier: page slots in one tensor on a CUDA device. ``capacity_bytes`` 0 disables it.

    ``device`` is a torch device name: "cuda", "cuda:N" ("cpu" runs the same tier in host memory).
    """

    capacity_bytes: int
    device: str = "cuda"

    if TYPE_CHECKING:  # sizes may be given as "64GiB": the generated __init__ parses them
        def __init__(self, capacity_bytes: int | str, device: str = "cuda") -> None: ...

    def __post_init__(self) -> None:
        object.__setattr__(self, "capacity_bytes", parse_size(self.capacity_bytes, "hbm.capacity_bytes"))
        if not isinstance(self.device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"hbm.device must be 'cuda', 'cuda:N' or 'cpu', got {self.device!r}")


@dataclass(frozen=True)
class DramConfig:
    """The host-DRAM tier. ``capacity_bytes`` is rounded down to whole pages.

    ``prefault``: a background thread faults the buffer's memory in after open, so that
    puts do not pay a page fault per 4 KiB on first touch (a page-locked buffer, used when
    CUDA is present, is resident from the start anyway); false leaves the memory to be
    faulted in as pages first land in it.

    ``copy_threads``: a batch of 16 MiB or more is copied into or out of the tier by up to
    this many threads at once (the calling thread and a pool's, taking 8 MiB chunks of
    its pages in turn; fewer while other large copies hold threads): one core's copy does
    not reach the memory's bandwidth. 0 (the default): the cores the process may run
    on, at most 4; 1 copies on the calling thread alone.
    """

    capacity_bytes: int
    prefault: bool = True
    copy_threads: int = 0

    if TYPE_CHECKING:  # sizes may be given as "64GiB": the generated __init__ parses them
        def __init__(self, capacity_bytes: int | str, prefault: bool = True, copy_threads: int = 0) -> None: ...

    def __post_init__(self) -> None:
        object.__setattr__(self, "capacity_bytes", parse_size(self.capacity_bytes, "dram.capacity_bytes"))
        _check_bool(self.prefault, "dram.prefault")
        _check_int(self.copy_threads, "dram.copy_threads", 0, 64)


@dataclass(frozen=True)
class NvmeConfig:
    """The local-NVMe tier: a file (created under the store directory by default) or a block device.

    ``o_direct`` asks for O_DIRECT; where the filesystem refuses it the tier falls back
    to buffered I/O with a warning. ``io_threads`` is the queue depth of the I/O pool.
    ``codec`` ("none", "lossless", "auto") codes pages with the lossless KV codec as
    they enter the tier; coded pages take fewer 4 KiB blocks, so the tier holds more
    of them. "auto" codes only where that makes transfers faster, from the codec's
    measured speed and the tier's bandwidth: ``bandwidth_gbps`` (GB/s) if set, else
    measured from the tier's own transfers.

    ``format``: the store may take ``path`` when it holds foreign data (a filesystem, a
    partition table, any non-zero bytes without a tierkv label), overwriting it. Without it
    a store takes only a missing path, an empty file, a blank medium, its own label (or that
    of an earlier store in its directory whose index was lost) and one ``tierkv format``
    marked; another store's label is refused either way (docs: configs/default.toml).

    ``lossy_bits`` (opt-in; 0, the default, keeps pages exact): exact pages that come
    down into this tier are converted to lossy pages at that budget (average bits an
    element, :mod:`tierkv.lossy`) in the background, and from then on are returned only
    to gets that accept lossy pages at that budget (docs/lossy.md, "A lossy tier").
    ``lossy_calibration``: a file ``tierkv calibrate`` wrote for the model, weighing each
    layer's keys and values in the bit allocation (without one, every layer weighs alike).

    ``io_uring``: true reads through io_uring (up to 32 reads in flight from the calling
    thread, which checks and copies out what has landed meanwhile; the pool of
    ``io_threads`` where this kernel refuses io_uring), false through the thread pool;
    unset, the pool unless the environment sets ``TIERKV_IO_URING=1``. Writes always use
    the pool (docs/benchmarks.md, "NVMe read path: io_uring vs thread pool").
    """

    capacity_bytes: int
    path: str | None = None
    o_direct: bool = True
    io_threads: int = 4
    codec: str = "none"
    bandwidth_gbps: float = 0.0
    format: bool = False
    lossy_bits: float = 0.0
    lossy_calibration: str | None = None
    io_uring: bool | None = None

    if TYPE_CHECKING:  # sizes may be given as "64GiB": the generated __init__ parses them
        def __init__(self, capacity_bytes: int | str, path: str | None = None, o_direct: bool = True,
                     io_threads: int = 4, codec: str = "none", bandwidth_gbps: float = 0.0,
                     format: bool = False, lossy_bits: float = 0.0, lossy_calibration: str | None = None,
                     io_uring: bool | None = None) -> None: ...

    def __post_init__(self) -> None:
        object.__setattr__(self, "capacity_bytes", parse_size(self.capacity_bytes, "nvme.capacity_bytes"))
        _check_codec(self, "nvme")
        _check_str(self.path, "nvme.path", path=True)
        _check_bool(self.format, "nvme.format")
        if self.io_uring is not None:
            _check_bool(self.io_uring, "nvme.io_uring")


_TRANSPORTS = ("rdma", "tcp", "loop")


@dataclass(frozen=True)
class NvmeofConfig:
    """The NVMe-oF tier: slots on a namespace exported by an NVMe-oF target.

    Either ``device`` names a block device that something else connected, or
    ``transport``/``traddr``/``trsvcid``/``subnqn`` say where to connect (the store
    connects at open through ``nvmeof``, finds the namespace ``nsid`` of that subsystem,
    and reconnects when the kernel gives up). ``capacity_bytes`` 0 takes the whole
    namespace. ``io_timeout_s`` bounds every transfer: past it, or on an I/O error, the
    tier is degraded (its pages are misses) until the monitor, polling every
    ``monitor_interval_s``, finds the namespace back with the store's label on it.
    ``ctrl_loss_tmo_s``, ``reconnect_delay_s`` and ``fast_io_fail_tmo_s`` are passed to
    the kernel's connect (-1 for ctrl_loss_tmo_s: reconnect forever). DH-HMAC-CHAP secrets
    are read from files (``DHHC-1:...`` lines), never written in the config itself.
    ``codec``, ``bandwidth_gbps``, ``format``, ``lossy_bits`` and ``lossy_calibration``
    are as for the NVMe tier.
    """

    capacity_bytes: int = 0
    device: str | None = None
    transport: str | None = None
    traddr: str | None = None
    trsvcid: str = "4420"
    subnqn: str | None = None
    nsid: int = 1
    hostnqn: str | None = None
    hostid: str | None = None
    dhchap_secret_file: str | None = None
    dhchap_ctrl_secret_file: str | None = None
    o_direct: bool = True
    io_threads: int = 4
    io_timeout_s: float = 5.0
    monitor_interval_s: float = 1.0
    connect_timeout_s: float = 15.0
    ctrl_loss_tmo_s: int = 600
    reconnect_delay_s: int = 1
    fast_io_fail_tmo_s: int = 2
    disconnect_on_close: bool = False
    codec: str = "none"
    bandwidth_gbps: float = 0.0
    format: bool = False
    lossy_bits: float = 0.0
    lossy_calibration: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "capacity_bytes", parse_size(self.capacity_bytes, "nvmeof.capacity_bytes"))
        _check_codec(self, "nvmeof")
        _check_bool(self.format, "nvmeof.format")
        for name in ("device", "dhchap_secret_file", "dhchap_ctrl_secret_file"):
            _check_str(getattr(self, name), f"nvmeof.{name}", path=True)
        for name in ("transport", "traddr", "subnqn", "hostnqn", "hostid"):
            _check_str(getattr(self, name), f"nvmeof.{name}")
        _check_bool(self.disconnect_on_close, "nvmeof.disconnect_on_close")
        port = self.trsvcid
        if isinstance(port, int) and not isinstance(port, bool) and 0 <= port <= 65535:
            object.__setattr__(self, "trsvcid", str(port))   # TOML's 4420: sysfs and nvme-cli speak text
        elif not isinstance(port, str) or not port:
            raise ConfigError(f"nvmeof.trsvcid must be a port number or service id, got {port!r}")
        if self.subnqn is None and self.device is None:
            raise ConfigError("nvmeof needs either device = \"/dev/nvmeXnY\" or transport, traddr and subnqn")
        if self.subnqn is not None:
            if self.transport not in _TRANSPORTS:
                raise ConfigError(f"nvmeof.transport must be one of {', '.join(_TRANSPORTS)}, got {self.transport!r}")
            if self.transport != "loop" and not self.traddr:
                raise ConfigError(f"nvmeof.traddr is required for transport {self.transport!r}")
        _check_int(self.nsid, "nvmeof.nsid", 1, 1 << 16)
        for name in ("io_timeout_s", "monitor_interval_s", "connect_timeout_s"):
            _check_number(getattr(self, name), f"nvmeof.{name}", "seconds", 0, MAX_SECONDS, low_open=True)
        for name in ("ctrl_loss_tmo_s", "reconnect_delay_s", "fast_io_fail_tmo_s"):
            _check_int(getattr(self, name), f"nvmeof.{name}", -1, _C_INT_MAX)


def _endpoint(text: object, what: str) -> tuple[str, int]:
    if not isinstance(text, str) or text.count(":") < 1:
        raise ConfigError(f"{what} must be 'host:port', got {text!r}")
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{what} must be 'host:port' with a port in 0..65535, got {text!r}")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class PeersConfig:
    """Handing pages between nodes (``tierkv.store.peering``, docs/rdma.md).

    ``serve = "host:port"`` exposes this store's DRAM tier to other nodes (read-only to
    them; port 0 picks a free one, see ``Store.peer_address``). ``fetch`` lists peers a
    ``get`` asks, in order, for the pages that follow the ones cached here; pages found
    there are loaded (checked against the peer's checksum) and stored here. ``transport``
    is "auto" (RDMA where pyverbs and a device exist, else TCP), "tcp" or "rdma";
    ``timeout_s`` bounds every peer operation: a slow or lost peer is a miss.

    Peers authenticate (``tierkv.net.auth``, docs/rdma.md "Authentication"):
    ``secret_file`` (required with ``serve`` or ``fetch``) holds the shared secret of
    this node's principal, a file of at least 16 bytes readable by its owner only. By
    default that principal is the cluster's, which may read every tenant's pages; with
    ``tenant`` set it is that tenant's, and this node then fetches only that tenant's
    pages. A serving node accepts the cluster's secret and, in ``tenant_secrets`` (tenant
    name -> secret file), secrets that each let their holder read only that tenant's
    pages. A read names the key of every page it wants; slot numbers alone return nothing.

    DualPath (``tierkv.dualpath``, docs/dualpath.md): ``helpers`` lists other nodes'
    ``serve`` endpoints that may read pages for this one from the storage peers they reach
    and push them here, into a landing zone of ``landing_pages`` slots served at
    ``landing = "host:port"``; ``dualpath`` is the policy that divides each fetch between
    this node's own reads and a helper ("pe-only", "shorter-queue" or "split"). A node
    with ``helper = true`` accepts such requests (from the cluster's principal) on its
    ``serve`` endpoint.
    """

    serve: str | None = None
    fetch: tuple[str, ...] = ()
    transport: str = "auto"
    timeout_s: float = 2.0
    secret_file: str | None = None
    tenant: str | None = None
    tenant_secrets: Mapping[str, str] = field(default_factory=dict)
    helpers: tuple[str, ...] = ()
    landing: str | None = None
    landing_pages: int = 256
    dualpath: str = "split"
    helper: bool = False

    def __post_init__(self) -> None:
        if self.serve is not None:
            _endpoint(self.serve, "peers.serve")
        if isinstance(self.fetch, str) or not isinstance(self.fetch, (list, tuple)):
            raise ConfigError(f"peers.fetch must be a list of 'host:port', got {self.fetch!r}")
        object.__setattr__(self, "fetch", tuple(self.fetch))
        for i, addr in enumerate(self.fetch):
            _endpoint(addr, f"peers.fetch[{i}]")
        if not isinstance(self.transport, str) or self.transport not in ("auto", "tcp", "rdma"):
            raise ConfigError(f"peers.transport must be auto, tcp or rdma, got {self.transport!r}")
        _check_number(self.timeout_s, "peers.timeout_s", "seconds", 0, MAX_SECONDS, low_open=True)
        if isinstance(self.secret_file, os.PathLike):
            object.__setattr__(self, "secret_file", os.fspath(self.secret_file))
        if self.secret_file is not None and (not isinstance(self.secret_file, str) or not self.secret_file
                                             or "\0" in self.secret_file):
            raise ConfigError(f"peers.secret_file must be a file's path, got {self.secret_file!r}")
        if (self.serve is not None or self.fetch) and self.secret_file is None:
            raise ConfigError("peers: serving or fetching pages needs peers.secret_file, the shared secret peers "
                              "prove they hold (make one with: head -c 32 /dev/urandom | base64 > FILE && "
                              "chmod 600 FILE, the same file on every node)")
        if self.tenant is not None and not isinstance(self.tenant, str):
            raise ConfigError(f"peers.tenant must be a tenant's name (text), got {self.tenant!r}")
        if not isinstance(self.tenant_secrets, Mapping) or not all(
                isinstance(k, str) and isinstance(v, (str, os.PathLike)) and v for k, v in self.tenant_secrets.items()):
            raise ConfigError("peers.tenant_secrets must map tenant names to secret files, got "
                              f"{self.tenant_secrets!r}")
        object.__setattr__(self, "tenant_secrets", {k: os.fspath(v) for k, v in self.tenant_secrets.items()})
        if isinstance(self.helpers, str) or not isinstance(self.helpers, (list, tuple)):
            raise ConfigError(f"peers.helpers must be a list of 'host:port', got {self.helpers!r}")
        object.__setattr__(self, "helpers", tuple(self.helpers))
        for i, addr in enumerate(self.helpers):
            _endpoint(addr, f"peers.helpers[{i}]")
        if self.landing is not None and _endpoint(self.landing, "peers.landing")[0] in ("0.0.0.0", "::", "*"):
            raise ConfigError(f"peers.landing = {self.landing!r}: helpers connect to this address, so it must be "
                              "one of this node's, not a wildcard")
        _check_int(self.landing_pages, "peers.landing_pages", 1, 1 << 20)
        if self.dualpath not in ("pe-only", "shorter-queue", "split"):
            raise ConfigError(f"peers.dualpath must be pe-only, shorter-queue or split, got {self.dualpath!r}")
        _check_bool(self.helper, "peers.helper")
        if self.helpers and self.landing is None:
            raise ConfigError("peers.helpers needs peers.landing = \"host:port\", where the helpers push the pages "
                              "they read for this node")
        if self.helpers and self.tenant is not None:
            raise ConfigError("peers.helpers: a helper pushes for the cluster's principal only; this node's "
                              f"principal is tenant {self.tenant!r}")
        if self.helper and self.serve is None:
            raise ConfigError("peers.helper = true needs peers.serve, the endpoint other nodes ask for help on")
        if self.helper and self.tenant is not None:
            raise ConfigError("peers.helper = true: pushes are asked by the cluster's principal, which a node whose "
                              f"principal is tenant {self.tenant!r} does not accept")

    def landing_endpoint(self) -> tuple[str, int] | None:
        return _endpoint(self.landing, "peers.landing") if self.landing is not None else None

    def helper_endpoints(self) -> list[tuple[str, int]]:
        return [_endpoint(a, "peers.helpers") for a in self.helpers]

    def serve_endpoint(self) -> tuple[str, int] | None:
        return _endpoint(self.serve, "peers.serve") if self.serve is not None else None

    def fetch_endpoints(self) -> list[tuple[str, int]]:
        return [_endpoint(a, "peers.fetch") for a in self.fetch]


def check_name(name: object, what: str) -> str:
    """A cluster or node name: 1-128 characters of letters, digits, ``-``, ``_`` and ``.``."""
    if not isinstance(name, str) or not 0 < len(name) <= 128 or not all(c.isalnum() or c in "-_." for c in name):
        raise ConfigError(f"{what} must be 1-128 letters, digits, '-', '_' or '.', got {name!r}")
    return name


@dataclass(frozen=True)
class ClusterConfig:
    """This node as a member of a cluster kept in etcd (``tierkv.cluster``, docs/cluster.md).

    ``etcd``: the etcd endpoints (``host:port``), tried in order. ``name``: the cluster's
    name (nodes of one name see each other). ``node``: this node's name in it (default the
    host name; unique among live members: a second daemon under a live node's name is
    refused). ``lease_ttl_s``: how long after its last renewal a node that stopped renewing
    (killed, partitioned away from etcd) leaves the cluster. ``timeout_s``: the deadline of
    every etcd call (the node serves its own tiers whatever etcd does).
    """

    etcd: tuple[str, ...] = ("127.0.0.1:2379",)
    name: str = "default"
    node: str | None = None
    lease_ttl_s: int = 10
    timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if isinstance(self.etcd, str) or not isinstance(self.etcd, (list, tuple)) or not self.etcd:
            raise ConfigError(f"cluster.etcd must be a non-empty list of 'host:port', got {self.etcd!r}")
        object.__setattr__(self, "etcd", tuple(self.etcd))
        for i, addr in enumerate(self.etcd):
            _endpoint(addr.removeprefix("http://") if isinstance(addr, str) else addr, f"cluster.etcd[{i}]")
        check_name(self.name, "cluster.name")
        if self.node is not None:
            check_name(self.node, "cluster.node")
        _check_int(self.lease_ttl_s, "cluster.lease_ttl_s", 2, 3600)
        _check_number(self.timeout_s, "cluster.timeout_s", "seconds", 0, 60, low_open=True)
        if self.timeout_s * 3 > self.lease_ttl_s:   # a renewal (every third of the TTL) must fit in it
            raise ConfigError(f"cluster.timeout_s ({self.timeout_s:g} s) must be at most a third of "
                              f"cluster.lease_ttl_s ({self.lease_ttl_s} s): a renewal runs every third of the lease")


@dataclass(frozen=True)
class ServeConfig:
    """The node service, ``tierkv serve`` (``tierkv.serve.daemon``, docs/serve.md).

    ``socket``: the Unix socket it listens on (default ``tierkv.sock`` in the store's
    directory). ``mode``: the socket's permissions as octal text ("0600": the daemon's
    user only; "0660": its group too). ``max_clients``: connections served at once.
    ``request_timeout_s``: how long a request's body may take to arrive once its header
    has. ``tenants`` ties connections to tenants by the peer's user (``SO_PEERCRED``):
    user name or uid -> the tenant names that user may use ("" is the default tenant,
    "*" every tenant). Empty (the default): whoever can open the socket may use every
    tenant; set: a user it does not name is refused. ``max_lent_fraction``: the most of
    the DRAM tier's rows one connection may hold lent at once (a lend past it lends
    nothing, or, not ``whole``, what fits; the client gets instead): lent rows of
    evicted pages are withheld from reuse until the lend ends.
    """

    socket: str | None = None
    mode: str = "0600"
    max_clients: int = 64
    request_timeout_s: float = 10.0
    tenants: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    max_lent_fraction: float = 0.5

    def __post_init__(self) -> None:
        if isinstance(self.socket, os.PathLike):
            object.__setattr__(self, "socket", os.fspath(self.socket))
        _check_str(self.socket, "serve.socket", path=True)
        if not isinstance(self.mode, str) or not re.fullmatch(r"0?[0-7]{3}", self.mode):
            raise ConfigError(f"serve.mode must be octal permission bits as text, such as \"0600\" or \"0660\", "
                              f"got {self.mode!r}")
        _check_int(self.max_clients, "serve.max_clients", 1, 1 << 16)
        _check_number(self.request_timeout_s, "serve.request_timeout_s", "seconds", 0, MAX_SECONDS, low_open=True)
        _check_number(self.max_lent_fraction, "serve.max_lent_fraction", "a fraction of the DRAM tier", 0, 1,
                      low_open=True)
        if not isinstance(self.tenants, Mapping):
            raise ConfigError(f"serve.tenants must map users to lists of tenant names, got {self.tenants!r}")
        tenants: dict[str, tuple[str, ...]] = {}
        for user, names in self.tenants.items():
            if not isinstance(user, str) or not user or isinstance(names, str) or not isinstance(names, (list, tuple)) \
                    or not all(isinstance(n, str) for n in names):
                raise ConfigError(f"serve.tenants: each user (a name or uid) maps to a list of tenant names, got "
                                  f"{user!r} = {names!r}")
            tenants[user] = tuple(names)
        object.__setattr__(self, "tenants", tenants)

    @property
    def mode_bits(self) -> int:
        return int(self.mode, 8)


@dataclass(frozen=True)
class StoreConfig:
    """Everything needed to open a store.

    ``path`` is the store directory (LMDB index, lock file, default NVMe data file).
    ``model_id`` salts every page key together with the layout and the tenant.
    ``persist_on_close`` copies pages that live only in DRAM to the NVMe tier on a
    clean close, so a restart finds them. ``verify_index`` says when a child process
    walks the LMDB index before it is trusted: "always" (default, about 60 ms plus the
    walk), "unclean" (only after a shutdown that left no clean marker) or "never".

    ``durability`` says when a page written to a persistent tier is durable: "window"
    when the group commit that covers it has run: one
    ``fdatasync`` of the data and one synced index commit for every page written within
    ``commit_window_s`` (or as soon as ``commit_window_pages`` are waiting), in the
    background, so ``put`` does not wait for the device; ``Store.flush()`` is the
    barrier; the default. "put": each batch is synced and committed before
    ``put`` returns. A crash loses at most the open
    window's pages (misses after a restart), never bytes of the wrong key.
    """

    path: str
    model_id: str
    layout: KVLayout
    dram: DramConfig | None = None
    nvme: NvmeConfig | None = None
    policy: str = DEFAULT_POLICY
    promote_on_hit: bool = True
    persist_on_close: bool = True
    verify_index: str = "always"
    hbm: HbmConfig | None = None
    nvmeof: NvmeofConfig | None = None
    peers: PeersConfig | None = None
    durability: str = DEFAULT_DURABILITY
    commit_window_s: float = DEFAULT_COMMIT_WINDOW_S
    commit_window_pages: int = DEFAULT_COMMIT_WINDOW_PAGES
    serve: ServeConfig | None = None
    cluster: ClusterConfig | None = None

    def __post_init__(self) -> None:
        if isinstance(self.path, os.PathLike):  # a pathlib.Path from the API: the field holds text
            object.__setattr__(self, "path", os.fspath(self.path))
        _check_str(self.path, "store.path", optional=False, path=True)
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ConfigError(f"store.model_id must be a non-empty string, got {self.model_id!r}")
        _check_bool(self.promote_on_hit, "store.promote_on_hit")
        _check_bool(self.persist_on_close, "store.persist_on_close")
        if not isinstance(self.layout, KVLayout):
            raise ConfigError(f"store.layout must be a KVLayout, got {self.layout!r}")
        for name, cls in (("dram", DramConfig), ("nvme", NvmeConfig), ("hbm", HbmConfig), ("nvmeof", NvmeofConfig),
                          ("peers", PeersConfig), ("serve", ServeConfig), ("cluster", ClusterConfig)):
            if not isinstance(getattr(self, name), (cls, type(None))):
                raise ConfigError(f"store.{name} must be a {cls.__name__} or None, got {getattr(self, name)!r}")
        if not isinstance(self.verify_index, str) or self.verify_index not in ("always", "unclean", "never"):
            raise ConfigError(f"store.verify_index must be 'always', 'unclean' or 'never', got {self.verify_index!r}")
        if not isinstance(self.durability, str) or self.durability not in DURABILITY_MODES:
            raise ConfigError(f"store.durability must be one of {', '.join(DURABILITY_MODES)}, "
                              f"got {self.durability!r}")
        _check_number(self.commit_window_s, "store.commit_window_s", "seconds", 0, 60, low_open=True)
        _check_int(self.commit_window_pages, "store.commit_window_pages", 1, 1 << 24)
        if not isinstance(self.policy, str) or self.policy not in STORE_POLICIES:
            raise ConfigError(f"unknown policy {self.policy!r}; expected one of {', '.join(STORE_POLICIES)}")
        if self.dram is None and self.nvme is None and self.nvmeof is None:
            raise ConfigError("a store needs at least one tier: set [tiers.dram], [tiers.nvme] or [tiers.nvmeof]")
        for name, tier in (("nvme", self.nvme), ("nvmeof", self.nvmeof)):
            if tier is not None and tier.codec != CodecMode.NONE.value \
                    and -(-self.layout.page_bytes // ALIGN) > MAX_PAGE_BLOCKS:
                raise ConfigError(f"tiers.{name}.codec = {tier.codec!r} addresses pages in 4 KiB blocks, at most "
                                  f"{MAX_PAGE_BLOCKS} per page; pages of {self.layout.page_bytes} bytes need "
                                  f"codec = \"none\"")
        self._check_lossy()

    def _check_lossy(self) -> None:
        """One lossy tier at most, with a tier above it, for pages lossy pages can code."""
        lossy = [name for name, t in (("nvme", self.nvme), ("nvmeof", self.nvmeof)) if t is not None and t.lossy_bits]
        if not lossy:
            return
        if len(lossy) > 1:
            raise ConfigError("tiers.nvme.lossy_bits and tiers.nvmeof.lossy_bits are both set: one tier converts "
                              "pages, and the tiers below it keep what it demotes")
        above = [t for t in (self.hbm, self.dram, self.nvme if lossy[0] == "nvmeof" else None) if t is not None]
        if not above:
            raise ConfigError(f"tiers.{lossy[0]}.lossy_bits needs a tier above it: pages are converted as they are "
                              "demoted into it, so a store of lossy tiers alone would never hold an exact page")
        lay = self.layout
        if lay.kind.value != "kv" or lay.dtype.value not in ("bf16", "fp16", "fp32"):
            raise ConfigError(f"tiers.{lossy[0]}.lossy_bits: lossy pages code K/V layouts of bf16, fp16 or fp32 "
                              f"pages; this layout is {lay.kind.value}, {lay.dtype.value}")
        from tierkv.lossy.format import min_budget

        least = min_budget(lay.num_layers, lay.tokens_per_page, lay.num_kv_heads, lay.head_dim)
        bits = (self.nvme if lossy[0] == "nvme" else self.nvmeof).lossy_bits  # type: ignore[union-attr]
        if bits < least:
            raise ConfigError(f"tiers.{lossy[0]}.lossy_bits = {bits:g} is below what pages of this layout code at "
                              f"keeping every token ({least:.3f} bits an element: headers, widths and parameters "
                              f"count); a lossy tier keeps every token")

    def socket_path(self) -> Path:
        """Where ``tierkv serve`` listens: ``[serve] socket``, else ``tierkv.sock`` in the store's directory."""
        sock = self.serve.socket if self.serve is not None else None
        return Path(sock) if sock else Path(self.path) / "tierkv.sock"

    def nvme_path(self) -> Path:
        """Where the NVMe tier's data lives (a file or a block device)."""
        assert self.nvme is not None
        if self.nvme.path is None:
            return Path(self.path) / "nvme.data"
        p = Path(os.path.expanduser(self.nvme.path))
        return p if p.is_absolute() else Path(self.path) / p


def _section(data: Mapping[str, object], name: str, source: str) -> dict[str, object]:
    value = data.get(name, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: [{name}] must be a table, got {type(value).__name__}")
    return value


def _build(cls: type, values: Mapping[str, object], where: str) -> object:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; expected some of {', '.join(sorted(known))}")
    try:
        return cls(**values)
    except TierKVError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def config_from_dict(data: Mapping[str, object], source: str = "<dict>",
                     layout: KVLayout | None = None) -> StoreConfig:
    """Build a StoreConfig from parsed TOML; ``source`` names the file in errors.

    ``layout``, if given, is used when the data has no ``[layout]`` table (a caller that
    sets the layout itself, as ``tierkv replay`` does); otherwise the table is required.
    """
    unknown_tables = sorted(set(data) - {"store", "layout", "tiers", "peers", "serve", "cluster"})
    if unknown_tables:  # a misspelt [tier.nvme] or [peer] must not silently drop a tier
        raise ConfigError(f"{source}: unknown top-level key(s) {', '.join(unknown_tables)}; "
                          "expected [store], [layout], [tiers.*], [peers], [serve] and [cluster]")
    store = _section(data, "store", source)
    if layout is None or "layout" in data:
        layout = _build(KVLayout, _section(data, "layout", source), f"{source} [layout]")  # type: ignore[assignment]
    tiers = _section(data, "tiers", source)
    unknown = sorted(set(tiers) - {"hbm", "dram", "nvme", "nvmeof"})
    if unknown:
        raise ConfigError(f"{source}: unknown tier(s) {', '.join(unknown)}; this build has hbm, dram, nvme and nvmeof")
    hbm = _build(HbmConfig, _section(tiers, "hbm", source), f"{source} [tiers.hbm]") if "hbm" in tiers else None
    dram = _build(DramConfig, _section(tiers, "dram", source), f"{source} [tiers.dram]") if "dram" in tiers else None
    nvme = _build(NvmeConfig, _section(tiers, "nvme", source), f"{source} [tiers.nvme]") if "nvme" in tiers else None
    nvmeof = (_build(NvmeofConfig, _section(tiers, "nvmeof", source), f"{source} [tiers.nvmeof]")
              if "nvmeof" in tiers else None)
    values = dict(store)
    if isinstance(values.get("path"), str):
        values["path"] = os.path.expanduser(str(values["path"]))
    peers = _build(PeersConfig, _section(data, "peers", source), f"{source} [peers]") if "peers" in data else None
    serve = _build(ServeConfig, _section(data, "serve", source), f"{source} [serve]") if "serve" in data else None
    cluster = (_build(ClusterConfig, _section(data, "cluster", source), f"{source} [cluster]")
               if "cluster" in data else None)
    values.update(layout=layout, dram=dram, nvme=nvme, hbm=hbm, nvmeof=nvmeof, peers=peers, serve=serve,
                  cluster=cluster)
    for key in ("layout", "dram", "nvme", "hbm", "nvmeof", "peers", "serve", "cluster"):
        if key in store:
            raise ConfigError(f"{source}: [store] may not set {key!r}; use its own table")
    cfg = _build(StoreConfig, values, f"{source} [store]")
    assert isinstance(cfg, StoreConfig)
    return cfg


def load_config(path: str | os.PathLike[str], layout: KVLayout | None = None) -> StoreConfig:
    """Read a TOML store config; relative ``store.path`` resolves against the current directory.
    ``layout`` stands in for a missing ``[layout]`` table (see :func:`config_from_dict`)."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {p} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {p}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: invalid TOML: {exc}") from None
    return config_from_dict(data, str(p), layout)
