"""Hardware profiles for ``tierkv plan``: GPUs, KV tiers, NICs and cluster shape, from TOML.

Named profiles ship inside the package as data, in ``tierkv/plan/profiles/*.toml``, so an
installed wheel finds them wherever it runs: ``load_profile("h200-node")`` finds one by
name; a path to any TOML file works too. Every tier's numbers are per node, except a
``shared`` tier (NVMe-oF by default) whose capacity and bandwidth are the pool's. Sizes and
bandwidths accept ``"64GiB"``, ``"50GB"`` (decimal, so ``"50GB"`` of bandwidth is
50e9 bytes/s) or plain numbers; capacities are whole bytes up to 1 EiB, bandwidths at
least 1 byte/s. A missing, unknown or out-of-range field raises
:class:`tierkv.errors.ConfigError` naming the file, the table and the field.
Called by :mod:`tierkv.cli.plan` and :mod:`tierkv.plan.planner`.
"""

from __future__ import annotations

import enum
import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from tierkv.errors import ConfigError
from tierkv.units import parse_size

#: Where named profiles live: beside this module, installed with it (``[tool.setuptools.package-data]``).
PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
#: The largest capacity a tier may have per node (or pool): 1 EiB, far past any KV cache, and small
#: enough that block counts stay within int64.
MAX_CAPACITY_BYTES = 2**60


class TierKind(enum.Enum):
    """The KV tiers the planner knows, fastest first (definition order is tier order)."""

    HBM = "hbm"
    DRAM = "dram"
    NVME = "nvme"
    NVMEOF = "nvmeof"


#: Rough street prices, US$ per GiB (2024-25): HBM3e ~ $15-25/GB as part of a GPU, server DDR5
#: ~ $3-5/GB, enterprise TLC NVMe ~ $0.08-0.12/GB, plus ~50% for NVMe-oF servers and network.
#: Only their ratios matter: the recommendation minimises the sum of capacity x price.
DEFAULT_COST_PER_GIB = {TierKind.HBM: 20.0, TierKind.DRAM: 4.0, TierKind.NVME: 0.1, TierKind.NVMEOF: 0.15}


@dataclass(frozen=True)
class TierSpec:
    """One tier. ``capacity_bytes`` None means "derive from the GPUs and the model" (HBM only).

    ``bandwidth_bytes_s`` is what the tier sustains for the node (or the pool, when
    ``shared``), reads and writes together; ``request_bandwidth_bytes_s`` is what one
    request's load gets; ``latency_s`` is paid once per request that loads from the tier.
    """

    kind: TierKind
    capacity_bytes: int | None
    bandwidth_bytes_s: float
    request_bandwidth_bytes_s: float
    latency_s: float
    cost_per_gib: float
    shared: bool = False


@dataclass(frozen=True)
class GpuSpec:
    """The GPUs of one node. ``prefill_mfu`` is the share of ``peak_flops`` prefill reaches;
    ``memory_utilization`` the share of HBM the engine takes; ``cache_fraction`` the share of
    the KV space left after weights that holds cached prefixes (the rest runs requests)."""

    count: int
    hbm_bytes: int
    hbm_bandwidth_bytes_s: float
    peak_flops: float
    prefill_mfu: float
    memory_utilization: float
    cache_fraction: float


@dataclass(frozen=True)
class NicSpec:
    """A class of NICs on every node: ``count`` of them, ``bandwidth_bytes_s`` each, per direction."""

    name: str
    count: int
    bandwidth_bytes_s: float
    reaches_storage: bool
    reaches_compute: bool


@dataclass(frozen=True)
class ClusterSpec:
    """How many nodes, and whether prefill and decode run on separate ones."""

    prefill_nodes: int
    decode_nodes: int
    disaggregated: bool

    @property
    def nodes(self) -> int:
        return self.prefill_nodes + self.decode_nodes if self.disaggregated else self.prefill_nodes


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    description: str
    gpu: GpuSpec
    cluster: ClusterSpec
    tiers: tuple[TierSpec, ...]
    nics: tuple[NicSpec, ...]
    prefill_tokens_s: tuple[tuple[str, float], ...] = ()

    def tier(self, kind: TierKind) -> TierSpec | None:
        return next((t for t in self.tiers if t.kind is kind), None)

    def measured_prefill_tokens_s(self, model: str) -> float | None:
        return dict(self.prefill_tokens_s).get(model)

    def with_capacity(self, kind: TierKind, capacity_bytes: int) -> HardwareProfile:
        """This profile with one tier resized; 0 removes it. Adding a tier the profile lacks is refused."""
        spec = self.tier(kind)
        if spec is None:
            if capacity_bytes == 0:
                return self
            raise ConfigError(f"hardware profile {self.name!r} has no {kind.value} tier to size to "
                              f"{capacity_bytes} bytes; add [tiers.{kind.value}] to the profile")
        if capacity_bytes == 0:
            return replace(self, tiers=tuple(t for t in self.tiers if t.kind is not kind))
        return replace(self, tiers=tuple(replace(t, capacity_bytes=capacity_bytes) if t is spec else t
                                         for t in self.tiers))


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


def load_profile(name_or_path: str | os.PathLike[str]) -> HardwareProfile:
    """A profile by name (``tierkv/plan/profiles/NAME.toml``) or by path."""
    p = Path(name_or_path)
    if not p.is_file():
        named = PROFILE_DIR / f"{name_or_path}.toml"
        if not named.is_file():
            raise ConfigError(f"hardware profile {str(name_or_path)!r} is neither a file nor one of "
                              f"{', '.join(profile_names()) or '(none found)'} in {PROFILE_DIR}")
        p = named
    try:
        data = tomllib.loads(p.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"hardware profile {str(p)!r} is not readable TOML ({exc})") from None
    return parse_profile(data, str(p))


def parse_profile(data: Mapping[str, object], where: str = "hardware profile") -> HardwareProfile:
    """Validate a profile's TOML tables; see ``tierkv/plan/profiles/h200-node.toml`` for every key."""
    _keys(data, where, "", {"profile", "cluster", "gpu", "tiers", "nics", "prefill_tokens_s"})
    meta = _Table(data.get("profile", {}), where, "profile", {"name", "description"})
    tiers_t = _table(data.get("tiers"), where, "tiers")
    _keys(tiers_t, where, "tiers", {k.value for k in TierKind})
    tiers = tuple(_tier(kind, tiers_t[kind.value], where) for kind in TierKind if kind.value in tiers_t)
    if not tiers:
        raise ConfigError(f"{where}: [tiers] names no tier; expected some of hbm, dram, nvme, nvmeof")
    prefill = _Table(data.get("prefill_tokens_s", {}), where, "prefill_tokens_s",
                     set(_table(data.get("prefill_tokens_s", {}), where, "prefill_tokens_s")))
    measured = tuple((key, prefill.positive(key)) for key in prefill.raw)
    cluster, nics = _cluster(data.get("cluster", {}), where), _nics(data.get("nics", []), where)
    if any(t.kind is TierKind.NVMEOF for t in tiers) and not any(n.reaches_storage for n in nics):
        raise ConfigError(f"{where}: [tiers.nvmeof] needs a [[nics]] entry with reaches_storage = true")
    if cluster.disaggregated and not any(n.reaches_compute for n in nics):
        raise ConfigError(f"{where}: prefill_nodes/decode_nodes need a [[nics]] entry that reaches compute "
                          "(reaches_storage = false, or reaches_compute = true)")
    return HardwareProfile(name=meta.str("name", Path(where).stem), description=meta.str("description", ""),
                           gpu=_gpu(data.get("gpu"), where), cluster=cluster, tiers=tiers, nics=nics,
                           prefill_tokens_s=measured)


def _gpu(raw: object, where: str) -> GpuSpec:
    t = _Table(raw, where, "gpu", {"count", "hbm_bytes", "hbm_bandwidth_bytes_s", "peak_flops", "prefill_mfu",
                                   "memory_utilization", "cache_fraction"})
    return GpuSpec(count=t.count("count"), hbm_bytes=t.capacity("hbm_bytes"),
                   hbm_bandwidth_bytes_s=t.bandwidth("hbm_bandwidth_bytes_s"), peak_flops=t.positive("peak_flops"),
                   prefill_mfu=t.fraction("prefill_mfu", 0.5), memory_utilization=t.fraction("memory_utilization", 0.9),
                   cache_fraction=t.fraction("cache_fraction", 0.5))


def _cluster(raw: object, where: str) -> ClusterSpec:
    t = _Table(raw, where, "cluster", {"nodes", "prefill_nodes", "decode_nodes"})
    if "prefill_nodes" in t.raw or "decode_nodes" in t.raw:
        if "nodes" in t.raw:
            raise ConfigError(f"{where}: [cluster] sets nodes and prefill_nodes/decode_nodes; use one or the other")
        return ClusterSpec(t.count("prefill_nodes"), t.count("decode_nodes"), disaggregated=True)
    return ClusterSpec(t.count("nodes", 1), 0, disaggregated=False)


def _tier(kind: TierKind, raw: object, where: str) -> TierSpec:
    name = f"tiers.{kind.value}"
    if kind is TierKind.HBM:  # bandwidth comes from [gpu]; capacity may be derived; never shared
        t = _Table(raw, where, name, {"capacity_bytes", "latency_s", "cost_per_gib"})
        cap = None if t.raw.get("capacity_bytes", "auto") == "auto" else t.capacity("capacity_bytes")
        return TierSpec(kind, cap, 0.0, 0.0, t.nonneg("latency_s", 0.0),
                        t.nonneg("cost_per_gib", DEFAULT_COST_PER_GIB[kind]))
    t = _Table(raw, where, name, {"capacity_bytes", "bandwidth_bytes_s", "request_bandwidth_bytes_s",
                                  "latency_s", "cost_per_gib", "shared"})
    bw = t.bandwidth("bandwidth_bytes_s")
    req_bw = t.bandwidth("request_bandwidth_bytes_s", bw)
    if req_bw > bw:
        raise ConfigError(f"{where}: [{name}] request_bandwidth_bytes_s ({req_bw:g}) must be <= bandwidth_bytes_s "
                          f"({bw:g}): one request's load cannot outrun the whole tier")
    return TierSpec(kind, t.capacity("capacity_bytes"), bw, req_bw, t.nonneg("latency_s"),
                    t.nonneg("cost_per_gib", DEFAULT_COST_PER_GIB[kind]), t.bool("shared", kind is TierKind.NVMEOF))


def _nics(raw: object, where: str) -> tuple[NicSpec, ...]:
    if not isinstance(raw, list):
        raise ConfigError(f"{where}: nics must be an array of tables ([[nics]]), got {type(raw).__name__}")
    out = []
    for i, item in enumerate(raw):
        t = _Table(item, where, f"nics[{i}]", {"name", "count", "bandwidth_bytes_s", "reaches_storage",
                                               "reaches_compute"})
        storage = t.bool("reaches_storage", False)
        out.append(NicSpec(t.str("name", f"nic{i}"), t.count("count", 1), t.bandwidth("bandwidth_bytes_s"),
                           storage, t.bool("reaches_compute", not storage)))
    return tuple(out)


def _table(raw: object, where: str, name: str) -> Mapping[str, object]:
    if not isinstance(raw, Mapping):
        if raw is None:
            raise ConfigError(f"{where}: missing table [{name}]")
        raise ConfigError(f"{where}: [{name}] must be a table, got {type(raw).__name__}")
    return raw


def _keys(raw: Mapping[str, object], where: str, name: str, allowed: set[str]) -> None:
    unknown = sorted(set(raw) - allowed)
    if unknown:
        table = f"[{name}]" if name else "the top level"
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} in {table}; "
                          f"expected some of {', '.join(sorted(allowed))}")


class _Table:
    """Typed fields of one TOML table; errors name the file, the table and the field."""

    def __init__(self, raw: object, where: str, name: str, allowed: set[str]) -> None:
        self.raw = _table(raw, where, name)
        self.where, self.name = where, name
        _keys(self.raw, where, name, allowed)

    def _get(self, key: str, default: object) -> object:
        if key not in self.raw:
            if default is None:
                raise ConfigError(f"{self.where}: [{self.name}] is missing {key}")
            return default
        return self.raw[key]

    def _bad(self, key: str, want: str) -> ConfigError:
        return ConfigError(f"{self.where}: [{self.name}] {key} must be {want}, got {self.raw.get(key)!r}")

    def size(self, key: str, default: float | None = None) -> float:
        """Bytes or bytes/s: a number, or a string like ``"64GiB"``; >= 0."""
        value = self._get(key, default)
        if isinstance(value, float) and not isinstance(value, bool):
            if not math.isfinite(value) or value < 0:
                raise self._bad(key, "a finite size >= 0")
            return value
        if isinstance(value, (int, str)) and not isinstance(value, bool):
            if isinstance(value, int) and value < 0 or isinstance(value, str) and value.strip().startswith("-"):
                raise self._bad(key, "a size >= 0")
            try:
                return float(parse_size(value, f"{self.where}: [{self.name}] {key}"))
            except OverflowError:  # hundreds of digits: no float holds them
                raise self._bad(key, "a finite size") from None
        raise self._bad(key, "a size such as 4096, 1.5e9 or '64GiB'")

    def capacity(self, key: str) -> int:
        """Whole bytes from 0 to :data:`MAX_CAPACITY_BYTES`."""
        value = self.size(key)
        if value != int(value):
            raise self._bad(key, "a whole number of bytes")
        if value > MAX_CAPACITY_BYTES:
            raise self._bad(key, "a size from 0 to 1 EiB")
        return int(value)

    def bandwidth(self, key: str, default: float | None = None) -> float:
        """Bytes/s, at least 1: a zero bandwidth would divide by zero or drop the traffic it carries."""
        value = self.size(key, default)
        if value < 1:
            raise self._bad(key, "a bandwidth >= 1 byte/s")
        return value

    def nonneg(self, key: str, default: float | None = None) -> float:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise self._bad(key, "a finite number >= 0")
        return float(value)

    def positive(self, key: str, default: float | None = None) -> float:
        value = self.nonneg(key, default)
        if value <= 0:
            raise self._bad(key, "a number > 0")
        return value

    def fraction(self, key: str, default: float) -> float:
        value = self.nonneg(key, default)
        if not 0 < value <= 1:
            raise self._bad(key, "a fraction in (0, 1]")
        return value

    def count(self, key: str, default: int | None = None) -> int:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self._bad(key, "an integer >= 1")
        return value

    def bool(self, key: str, default: bool) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise self._bad(key, "true or false")
        return value

    def str(self, key: str, default: str) -> str:
        value = self._get(key, default)
        if not isinstance(value, str):
            raise self._bad(key, "a string")
        return value
