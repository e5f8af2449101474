"""``tierkv doctor``: a preflight of this host for the RDMA and NVMe-oF tiers (and the
huge pages of the DRAM tier's shared memory).

Registered by ``tierkv.cli.main``. Reads sysfs (RDMA devices and ports, netdev MTU and ECN,
modules, NVMe controllers through ``nvmeof.sysfs``), a few files under ``/etc/nvme``, and
asks a few tools (``dcb``, ``ibv_devinfo``, ``nvme``, ``/usr/bin/python3``) when they are
installed. It changes nothing. Each check yields a line: PASS, WARN (works, but not as the
tiers want it), FAIL (the tiers cannot work) or SKIP (could not be checked here, with why).
Roots and tool runners are parameters (``Probe``) so that tests run against fake trees.
"""

from __future__ import annotations

import argparse
import enum
import importlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from nvmeof.sysfs import ControllerState, list_controllers
from tierkv.cli.exits import EXIT_FAILED, EXIT_OK

SYSTEM_PYTHON = "/usr/bin/python3"
ROCE_MTU = 9000
_FABRICS = ("rdma", "tcp", "fc", "loop")


class Status(enum.Enum):
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"


@dataclass(frozen=True)
class Check:
    """One checklist line: ``check`` is a dotted name (``rdma.mlx5_0.port1.state``)."""

    check: str
    status: Status
    detail: str

    def as_json(self) -> dict[str, str]:
        return {"check": self.check, "status": self.status.value, "detail": self.detail}


def _run(argv: Sequence[str]) -> tuple[int, str]:
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 127, str(exc)
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def _imports(module: str) -> bool:
    try:
        importlib.import_module(module)
        return True
    except Exception:                                 # any import failure means "not usable"
        return False


@dataclass(frozen=True)
class Probe:
    """Where doctor looks. ``which`` finds a tool, ``run`` returns (exit status, output),
    ``imports`` says whether this interpreter imports a module."""

    sysfs_root: str = "/sys"
    dev_root: str = "/dev"
    etc_root: str = "/etc"
    which: Callable[[str], str | None] = field(default=shutil.which)
    run: Callable[[Sequence[str]], tuple[int, str]] = field(default=_run)
    imports: Callable[[str], bool] = field(default=_imports)

    def sys(self, *parts: str) -> str:
        return os.path.join(self.sysfs_root, *parts)


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def _ls(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def rdma_checks(p: Probe) -> list[Check]:
    """RDMA devices, their ports (state, link layer, active MTU) and the netdevs under them."""
    devices = _ls(p.sys("class", "infiniband"))
    if not devices:
        return [Check("rdma.devices", Status.FAIL, "no RDMA devices in /sys/class/infiniband: load "
                      "the NIC's RDMA driver (mlx5_ib, ...) or add soft-RoCE (rdma link add rxe0 "
                      "type rxe netdev IF)")]
    out = [Check("rdma.devices", Status.PASS, ", ".join(devices))]
    netdevs: dict[str, str] = {}
    for dev in devices:
        base = p.sys("class", "infiniband", dev)
        if dev.startswith("rxe") or os.path.exists(os.path.join(base, "parent")):
            out.append(Check(f"rdma.{dev}.kind", Status.WARN, "soft-RoCE (rdma_rxe): correct but "
                             "CPU-bound; fine for tests, not for serving throughput"))
        for port in _ls(os.path.join(base, "ports")):
            out += _port_checks(p, dev, port, netdevs)
    for ifname, layer in sorted(netdevs.items()):
        out += _netdev_checks(p, ifname, layer)
    uverbs = [n for n in _ls(os.path.join(p.dev_root, "infiniband")) if n.startswith("uverbs")]
    out.append(Check("rdma.uverbs", Status.PASS if uverbs else Status.WARN,
                     ", ".join(uverbs) if uverbs else "no /dev/infiniband/uverbs*: user-space "
                     "verbs (pyverbs, GPU/DRAM RDMA tiers) need ib_uverbs loaded"))
    return out


def _port_checks(p: Probe, dev: str, port: str, netdevs: dict[str, str]) -> list[Check]:
    base = p.sys("class", "infiniband", dev, "ports", port)
    name = f"rdma.{dev}.port{port}"
    state = _read(os.path.join(base, "state")) or "unreadable"
    layer = _read(os.path.join(base, "link_layer")) or "unknown"
    out = [Check(f"{name}.state", Status.PASS if "ACTIVE" in state else Status.FAIL,
                 f"{state} (phys {_read(os.path.join(base, 'phys_state')) or '?'}, "
                 f"rate {_read(os.path.join(base, 'rate')) or '?'})"),
           Check(f"{name}.link_layer", Status.PASS, layer + (" (RoCE)" if layer == "Ethernet" else ""))]
    out.append(_active_mtu(p, dev, port, name))
    ndevs = os.path.join(base, "gid_attrs", "ndevs")
    for gid in _ls(ndevs):
        ifname = _read(os.path.join(ndevs, gid))
        if ifname:
            netdevs[ifname] = layer
    if layer == "Ethernet":
        types = {_read(os.path.join(base, "gid_attrs", "types", g)) for g in _ls(ndevs)}
        v2 = any(t and "v2" in t.lower() for t in types)
        out.append(Check(f"{name}.roce_v2", Status.PASS if v2 else Status.WARN,
                         "RoCE v2 GIDs present" if v2 else "no RoCE v2 GID: the netdev needs an "
                         "IP address (RoCE v2 is routable UDP; v1 is not)"))
    return out


def _active_mtu(p: Probe, dev: str, port: str, name: str) -> Check:
    # active_mtu is not a sysfs attribute; only a verbs query (ibv_devinfo) reports it
    if p.which("ibv_devinfo") is None:
        return Check(f"{name}.active_mtu", Status.SKIP, "not in sysfs and ibv_devinfo is not "
                     "installed (apt-get install ibverbs-utils)")
    code, text = p.run(["ibv_devinfo", "-d", dev, "-i", port])
    m = re.search(r"active_mtu:\s*(\d+)", text)
    if code != 0 or m is None:
        return Check(f"{name}.active_mtu", Status.SKIP, f"ibv_devinfo gave no active_mtu: {text[:120]}")
    mtu = int(m.group(1))
    return Check(f"{name}.active_mtu", Status.PASS if mtu >= 4096 else Status.WARN,
                 f"{mtu}" + ("" if mtu >= 4096 else ": below 4096, each RDMA message is split into "
                             "more packets (raise the netdev MTU to 9000)"))


def _netdev_checks(p: Probe, ifname: str, layer: str) -> list[Check]:
    out = []
    mtu_text = _read(p.sys("class", "net", ifname, "mtu"))
    if mtu_text is None or not mtu_text.isdigit():
        out.append(Check(f"net.{ifname}.mtu", Status.SKIP, f"/sys/class/net/{ifname}/mtu not readable"))
    elif layer == "Ethernet" and int(mtu_text) < ROCE_MTU:
        out.append(Check(f"net.{ifname}.mtu", Status.WARN, f"{mtu_text}, {ROCE_MTU} expected for "
                         "RoCEv2: the RDMA path MTU follows the netdev MTU (1500 -> 1024-byte RDMA "
                         "MTU, 9000 -> 4096), so every page moves in 4x the packets; set 9000 on "
                         "the NIC and the switch ports"))
    else:
        out.append(Check(f"net.{ifname}.mtu", Status.PASS, mtu_text))
    if layer == "Ethernet":
        out.append(_ecn(p, ifname))
        out.append(_pfc(p, ifname))
    return out


def _ecn(p: Probe, ifname: str) -> Check:
    base = p.sys("class", "net", ifname, "ecn")
    if not os.path.isdir(base):
        return Check(f"net.{ifname}.ecn", Status.SKIP, "not readable on this device (no "
                     "/sys/class/net/IF/ecn: only mlx5 netdevs expose DCQCN ECN there)")
    enabled = {}
    for role in ("roce_np", "roce_rp"):
        d = os.path.join(base, role, "enable")
        enabled[role] = [prio for prio in _ls(d) if _read(os.path.join(d, prio)) == "1"]
    if all(enabled.values()):
        return Check(f"net.{ifname}.ecn", Status.PASS, "DCQCN ECN enabled: " + "; ".join(
            f"{r} prio {','.join(v)}" for r, v in enabled.items()))
    return Check(f"net.{ifname}.ecn", Status.WARN, "DCQCN ECN off for " + ", ".join(
        r for r, v in enabled.items() if not v) + ": congestion then relies on PFC pauses alone")


def _pfc(p: Probe, ifname: str) -> Check:
    name = f"net.{ifname}.pfc"
    if p.which("dcb") is not None:
        code, text = p.run(["dcb", "pfc", "show", "dev", ifname])
        m = re.search(r"prio-pfc\s+((?:\d+:(?:on|off)\s*)+)", text)
        if code == 0 and m:
            on = [x.split(":")[0] for x in m.group(1).split() if x.endswith(":on")]
            return Check(name, Status.PASS if on else Status.WARN,
                         f"PFC on priorities {','.join(on)}" if on else "PFC off on every priority: "
                         "RoCE then needs a lossless fabric some other way (or loses to drops)")
        return Check(name, Status.SKIP, f"not readable on this device (dcb: {text[:120] or code})")
    if p.which("lldptool") is not None:
        code, text = p.run(["lldptool", "-t", "-i", ifname, "-V", "PFC"])
        m = re.search(r"enabled:\s*([^\n]*)", text)
        if code == 0 and m:
            prios = m.group(1).strip()
            ok = bool(prios) and prios.lower() != "none"
            return Check(name, Status.PASS if ok else Status.WARN,
                         f"PFC enabled: {prios}" if ok else "PFC enabled on no priority")
        return Check(name, Status.SKIP, f"not readable on this device (lldptool: {text[:120] or code})")
    return Check(name, Status.SKIP, "dcb and lldptool not installed (apt-get install iproute2 or lldpad)")


def module_checks(p: Probe) -> list[Check]:
    """NVMe-fabrics host and target modules, /dev/nvme-fabrics, nvmet configfs."""
    fabrics = os.path.exists(os.path.join(p.dev_root, "nvme-fabrics"))

    def loaded(mod: str) -> bool:  # a built-in nvme_fabrics has no /sys/module entry
        return os.path.isdir(p.sys("module", mod)) or (mod == "nvme_fabrics" and fabrics)
    out = []
    for mod, missing in (("nvme_fabrics", Status.FAIL), ("nvme_rdma", Status.FAIL),
                         ("nvme_tcp", Status.WARN)):
        out.append(Check(f"module.{mod}", Status.PASS if loaded(mod) else missing, "loaded" if
                         loaded(mod) else f"not loaded (modprobe {mod.replace('_', '-')})"
                         + ("; NVMe/TCP is the fallback transport" if mod == "nvme_tcp" else "")))
    out.append(Check("dev.nvme-fabrics", Status.PASS if fabrics else Status.FAIL,
                     "present" if fabrics else "missing: connects need nvme_fabrics loaded"))
    if not loaded("nvmet"):
        out.append(Check("module.nvmet", Status.SKIP, "not loaded; needed only where this host "
                         "serves a target (modprobe nvmet nvmet-rdma)"))
        return out
    out.append(Check("module.nvmet", Status.PASS, "loaded"))
    for mod in ("nvmet_rdma", "nvmet_tcp"):
        out.append(Check(f"module.{mod}", Status.PASS if loaded(mod) else Status.WARN,
                         "loaded" if loaded(mod) else f"not loaded: no {mod[6:]} target ports"))
    cfg = os.path.isdir(p.sys("kernel", "config", "nvmet"))
    out.append(Check("configfs.nvmet", Status.PASS if cfg else Status.FAIL, "/sys/kernel/config/nvmet"
                     if cfg else "nvmet loaded but configfs not mounted (mount -t configfs none "
                     "/sys/kernel/config)"))
    return out


def controller_checks(p: Probe) -> list[Check]:
    """Connected fabrics controllers and their states; the host NQN and ID files."""
    out = []
    ctrls = [c for c in list_controllers(p.sysfs_root) if c.transport in _FABRICS]
    if not ctrls:
        out.append(Check("nvme.controllers", Status.SKIP, "no NVMe-oF controllers connected"))
    for c in ctrls:
        status = {ControllerState.LIVE: Status.PASS, ControllerState.CONNECTING: Status.WARN,
                  ControllerState.RESETTING: Status.WARN, ControllerState.NEW: Status.WARN}.get(
                      c.state, Status.FAIL)
        out.append(Check(f"nvme.{c.name}", status, f"{c.state.value}: {c.transport} "
                         f"{c.address.traddr}:{c.address.trsvcid} {c.subsysnqn} "
                         f"namespaces {','.join(c.namespaces) or 'none'}"))
    for fname, why in (("hostnqn", "nvme gen-hostnqn > /etc/nvme/hostnqn; without it each boot "
                        "gets a random NQN that no allow-list can name"),
                       ("hostid", "uuidgen > /etc/nvme/hostid")):
        value = _read(os.path.join(p.etc_root, "nvme", fname))
        out.append(Check(f"nvme.{fname}", Status.PASS if value else Status.WARN,
                         value if value else f"/etc/nvme/{fname} missing: {why}"))
    return out


def software_checks(p: Probe) -> list[Check]:
    """pyverbs and libnvme from this interpreter and from /usr/bin/python3; nvme-cli."""
    out = []
    system = p.which(SYSTEM_PYTHON) is not None or os.path.exists(SYSTEM_PYTHON)
    have: dict[str, bool] = {}
    for mod in ("pyverbs", "libnvme"):
        here = p.imports(mod)
        sys_ok = system and p.run([SYSTEM_PYTHON, "-c", f"import {mod}"])[0] == 0
        have[mod] = sys_ok or here
        detail = f"this interpreter: {'yes' if here else 'no'}; {SYSTEM_PYTHON}: " + (
            ("yes" if sys_ok else "no") if system else "absent")
        if not here and sys_ok and mod == "pyverbs":
            detail += " (use a venv from /usr/bin/python3 with --system-site-packages)"
        if not sys_ok and not here:
            detail += f" (apt-get install python3-{'pyverbs' if mod == 'pyverbs' else 'nvme'})"
        out.append(Check(f"python.{mod}", Status.PASS if (here or (sys_ok and mod == "libnvme"))
                         else Status.WARN, detail))
    cli = p.which("nvme")
    if cli is not None:
        version = p.run(["nvme", "version"])[1].splitlines()
        out.append(Check("tool.nvme-cli", Status.PASS, version[0] if version else cli))
    else:
        out.append(Check("tool.nvme-cli", Status.WARN if have["libnvme"] else Status.FAIL,
                         "not installed (apt-get install nvme-cli)" + (
                             "; libnvme can connect instead" if have["libnvme"] else
                             "; and libnvme is not importable either: nothing can connect")))
    return out


def memory_checks(p: Probe) -> list[Check]:
    """Huge pages: for shared memory (the DRAM tier's pool and ``tierkv serve``'s page
    buffers are memfds, which get them only where ``shmem_enabled`` allows), and for the
    private buffers direct I/O moves (the NVMe tiers' bounce and staging buffers, the
    store's read rows: ``transparent_hugepage/enabled``)."""
    return [_shmem_check(p), _private_check(p)]


def _shmem_check(p: Probe) -> Check:
    from tierkv.tiers.hugepages import HUGE_MODES, SHMEM_ENABLED, SHMEM_ENABLED_2M, shmem_huge_state

    name = "memory.shmem_huge_pages"
    main, own = shmem_huge_state(p.sysfs_root)
    if main == "unknown":
        return Check(name, Status.SKIP, "transparent_hugepage/shmem_enabled is not readable here")
    # Either way is a working setup with its own costs (docs/serve.md, Huge pages): a line
    # that says which, and which switch decides it, not a warning.
    if main not in HUGE_MODES:
        return Check(name, Status.PASS, f"{main}: the DRAM pool and page buffers use 4 KiB pages (demotions to "
                                        f"NVMe go through its huge-page bounce buffers); huge pages "
                                        f"(/sys/{SHMEM_ENABLED}) speed large copies and slow a large pool's "
                                        "first fill, see docs/serve.md")
    if own == "never":
        return Check(name, Status.PASS, f"{main}, but never for 2 MiB pages (/sys/{SHMEM_ENABLED_2M}): the DRAM "
                                        "pool and page buffers use 4 KiB pages")
    return Check(name, Status.PASS, f"{main}: the DRAM pool and page buffers get huge pages (a large pool's first "
                                    "fill is slower, see docs/serve.md)")


def _private_check(p: Probe) -> Check:
    from tierkv.tiers.hugepages import THP_ENABLED, THP_ENABLED_2M, private_huge_mode, private_huge_state

    name = "memory.io_huge_pages"
    mode = private_huge_mode(p.sysfs_root)
    if mode == "unknown":
        return Check(name, Status.SKIP, "transparent_hugepage/enabled is not readable here")
    own = private_huge_state(p.sysfs_root)[1]
    switch = THP_ENABLED_2M if own is not None and own != "inherit" else THP_ENABLED   # the one that decides
    if mode == "never":
        return Check(name, Status.WARN, f"never (/sys/{switch}): the buffers direct I/O moves (NVMe bounce "
                                        "and staging, the store's read rows) get 4 KiB pages, which a disk with few "
                                        "segments a request (virtio) reads and writes up to 2x slower; set madvise")
    return Check(name, Status.PASS, f"{mode} (/sys/{switch}): the buffers direct I/O moves (NVMe bounce and staging, "
                                    "the store's read rows) get huge pages")


def run_checks(probe: Probe | None = None) -> list[Check]:
    """Every check, in checklist order. Never raises for what it finds on the host."""
    p = probe or Probe()
    return rdma_checks(p) + module_checks(p) + controller_checks(p) + software_checks(p) + memory_checks(p)


def summary(checks: Sequence[Check]) -> dict[str, int]:
    return {s.value: sum(c.status is s for c in checks) for s in Status}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Add ``doctor`` to a ``tierkv`` subparsers object; returns the new parser."""
    dp = subparsers.add_parser(
        "doctor", help="check this host for the RDMA and NVMe-oF tiers",
        description="Preflight for the RDMA tiers: RDMA devices and ports, netdev MTU, PFC/ECN, "
                    "NVMe-fabrics host and target modules, connected controllers, host NQN, "
                    "pyverbs/libnvme, nvme-cli, huge pages for shared memory and for direct-I/O buffers. Exit status 1 if any check fails.")
    dp.add_argument("--json", action="store_true", help="print one JSON object instead of the list")
    dp.add_argument("--sysfs-root", default="/sys", help=argparse.SUPPRESS)
    dp.add_argument("--dev-root", default="/dev", help=argparse.SUPPRESS)
    dp.add_argument("--etc-root", default="/etc", help=argparse.SUPPRESS)
    dp.set_defaults(handler=run)
    return dp


def run(args: argparse.Namespace) -> int:
    """The handler of ``tierkv doctor``: 1 if any check fails, else 0."""
    checks = run_checks(Probe(args.sysfs_root, args.dev_root, args.etc_root))
    counts = summary(checks)
    if args.json:
        print(json.dumps({"checks": [c.as_json() for c in checks], "summary": counts}, indent=2))
    else:
        for c in checks:
            print(f"[{c.status.value.upper():4}] {c.check}: {c.detail}")
        print("summary: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return EXIT_FAILED if counts[Status.FAIL.value] else EXIT_OK
