"""The tool side of ``nvmeof.host``: nvme-cli command lines and output, and the libnvme child.

Called only by ``nvmeof.host``. The builders and parsers are pure functions so that tests
can check the exact argv and parsing without a kernel; ``run`` and ``run_libnvme`` are the
only places a subprocess is started. Option
names are those of nvme-cli 2.x (Debian 12 ships 2.3): ``--ctrl-loss-tmo``,
``--reconnect-delay``, ``--keep-alive-tmo``, ``--dhchap-secret``, ``--dhchap-ctrl-secret``
are dashed, while ``--fast_io_fail_tmo`` (only from nvme-cli 2.4) is spelled with
underscores in nvme-cli's own option table. Options the installed nvme-cli lacks are
reported by ``unsupported_options`` so that the caller can set them through sysfs instead.
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "CliResult", "ConnectOptions", "connect_args", "connected_device", "discover_args", "parse_discovery", "run",
    "supported_options", "unsupported_options",
]

NVME = "nvme"
LIBNVME_PYTHON = "/usr/bin/python3"   # Debian's python3-nvme imports only here
FAST_IO_FAIL_FLAG = "--fast_io_fail_tmo"


@dataclass(frozen=True)
class ConnectOptions:
    """What ``nvme connect`` is asked for. Times are whole seconds, as the kernel takes them."""

    transport: str
    traddr: str
    trsvcid: str
    nqn: str
    hostnqn: str | None = None
    hostid: str | None = None
    dhchap_secret: str | None = None
    dhchap_ctrl_secret: str | None = None
    ctrl_loss_tmo_s: int | None = None
    reconnect_delay_s: int | None = None
    fast_io_fail_tmo_s: int | None = None
    keep_alive_tmo_s: int | None = None


@dataclass(frozen=True)
class CliResult:
    """One finished nvme-cli run."""

    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str


def discover_args(transport: str, traddr: str, trsvcid: str, *, hostnqn: str | None = None,
                  hostid: str | None = None) -> list[str]:
    """argv of ``nvme discover ... -o json``."""
    argv = [NVME, "discover", f"--transport={transport}", f"--traddr={traddr}",
            f"--trsvcid={trsvcid}"]
    argv += _host_args(hostnqn, hostid)
    return argv + ["--output-format=json"]


def connect_args(opts: ConnectOptions, *, fast_io_fail_flag: bool = True) -> list[str]:
    """argv of ``nvme connect ... -o json``.

    With ``fast_io_fail_flag=False`` (an nvme-cli without ``--fast_io_fail_tmo``) that
    option is left out and the caller must set it in sysfs after the connect. Secrets are
    passed as arguments, as nvme-cli takes them: they are visible in ``ps`` for the
    command's lifetime, and ``host`` never puts an argv into an exception message.
    Over ``loop`` there is no service id and nothing to reconnect: ``--trsvcid``,
    ``--ctrl-loss-tmo`` and ``--reconnect-delay`` (options the kernel's nvme-loop does not
    take) are left out, and so is an empty ``--traddr``.
    """
    loop = opts.transport == "loop"
    argv = [NVME, "connect", f"--transport={opts.transport}"]
    argv += [f"--traddr={opts.traddr}"] if opts.traddr or not loop else []
    argv += [f"--trsvcid={opts.trsvcid}"] if not loop else []
    argv.append(f"--nqn={opts.nqn}")
    argv += _host_args(opts.hostnqn, opts.hostid)
    if opts.dhchap_secret is not None:
        argv.append(f"--dhchap-secret={opts.dhchap_secret}")
    if opts.dhchap_ctrl_secret is not None:
        argv.append(f"--dhchap-ctrl-secret={opts.dhchap_ctrl_secret}")
    for flag, value in (("--ctrl-loss-tmo", None if loop else opts.ctrl_loss_tmo_s),
                        ("--reconnect-delay", None if loop else opts.reconnect_delay_s),
                        ("--keep-alive-tmo", opts.keep_alive_tmo_s)):
        if value is not None:
            argv.append(f"{flag}={value}")
    if opts.fast_io_fail_tmo_s is not None and fast_io_fail_flag:
        argv.append(f"{FAST_IO_FAIL_FLAG}={opts.fast_io_fail_tmo_s}")
    return argv + ["--output-format=json"]


def _host_args(hostnqn: str | None, hostid: str | None) -> list[str]:
    out = []
    if hostnqn is not None:
        out.append(f"--hostnqn={hostnqn}")
    if hostid is not None:
        out.append(f"--hostid={hostid}")
    return out


def supported_options(help_text: str) -> frozenset[str]:
    """The long options (``--ctrl-loss-tmo``) that ``nvme connect --help`` lists."""
    return frozenset(re.findall(r"(--[A-Za-z][A-Za-z0-9_-]*)", help_text))


def unsupported_options(opts: ConnectOptions, supported: frozenset[str]) -> list[str]:
    """The long options ``connect_args(opts)`` would need that ``supported`` lacks."""
    needed = {flag.split("=", 1)[0] for flag in connect_args(opts)[2:]}
    return sorted(needed - supported)


def _load(stdout: str) -> object:
    """JSON from nvme-cli's stdout; some versions print a line of text before it."""
    text = stdout.strip()
    start = min((i for i in (text.find("{"), text.find("[")) if i >= 0), default=-1)
    if start < 0:
        raise ValueError(f"expected JSON from nvme-cli, got {text[:200]!r}")
    return json.loads(text[start:])


def parse_discovery(stdout: str) -> list[Mapping[str, object]]:
    """The records of ``nvme discover -o json`` (1.x and 2.x: ``{"records": [...]}``).

    Raises ValueError when the output is not JSON or holds no ``records`` list.
    """
    doc = _load(stdout)
    records = doc.get("records") if isinstance(doc, dict) else None
    if not isinstance(records, list):
        raise ValueError(f"expected a 'records' list in nvme discover's JSON, got {str(doc)[:200]}")
    return [r for r in records if isinstance(r, dict)]


def connected_device(stdout: str) -> str | None:
    """The controller name ``nvme connect`` reported (``{"device": "nvme0"}`` or text)."""
    try:
        doc = _load(stdout)
        if isinstance(doc, dict) and isinstance(doc.get("device"), str):
            return str(doc["device"])
    except ValueError:
        pass
    m = re.search(r"\b(nvme\d+)\b", stdout)
    return m.group(1) if m else None


def run(argv: Sequence[str], timeout_s: float) -> CliResult:
    """Run nvme-cli; never raises for a non-zero exit (the caller judges the result).

    Raises FileNotFoundError if ``nvme`` is not installed, subprocess.TimeoutExpired if it
    runs past ``timeout_s`` (the child is killed).
    """
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s,
                          check=False, stdin=subprocess.DEVNULL)
    return CliResult(tuple(argv), proc.returncode, proc.stdout, proc.stderr)


@functools.lru_cache(maxsize=1)
def connect_options() -> frozenset[str]:
    """The long options of the installed ``nvme connect`` (empty if nvme-cli is missing)."""
    try:
        res = run([NVME, "connect", "--help"], timeout_s=10)
    except (OSError, subprocess.TimeoutExpired):
        return frozenset()
    return supported_options(res.stdout + res.stderr)


@functools.lru_cache(maxsize=1)
def libnvme_available() -> bool:
    """Whether ``/usr/bin/python3`` imports libnvme's bindings (checked once per process)."""
    try:
        return subprocess.run([LIBNVME_PYTHON, "-c", "import libnvme.nvme"], capture_output=True,
                              timeout=30, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@dataclass(frozen=True)
class LibnvmeResult:
    """One finished libnvme child: its reply (``{"error": ...}`` on failure), exit, stderr."""

    reply: Mapping[str, object]
    returncode: int
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and "error" not in self.reply


# The libnvme child: one request as JSON on stdin, one JSON line on stdout, then os._exit
# so that the SWIG destructors (which can segfault in libnvme 1.3) never run.
_LIBNVME_CHILD = r"""
import json, os, sys
def main(req):
    from libnvme import nvme
    r = nvme.root()
    h = nvme.host(r, hostnqn=req.get("hostnqn"), hostid=req.get("hostid"))
    if req.get("dhchap_secret"):
        h.dhchap_key = req["dhchap_secret"]
    nqn = req.get("nqn") or nvme.NVME_DISC_SUBSYS_NAME
    c = nvme.ctrl(r, subsysnqn=nqn, transport=req["transport"], traddr=req["traddr"],
                  trsvcid=req["trsvcid"])
    c.connect(h, cfg=req.get("cfg") or None)
    if req["op"] == "connect":
        return {"device": c.name}
    try:
        return {"records": [dict(rec) for rec in (c.discover() or [])]}
    finally:
        c.disconnect()
try:
    out = main(json.loads(sys.stdin.read()))
    code = 0
except Exception as exc:
    out, code = {"error": "%s: %s" % (type(exc).__name__, exc)}, 3
sys.stdout.write(json.dumps(out, default=str) + "\n")
sys.stdout.flush()
os._exit(code)
"""


def run_libnvme(request: Mapping[str, object], timeout_s: float) -> LibnvmeResult:
    """Run one request (``op`` "connect" or "discover") in a libnvme child process.

    A crash of the child (libnvme 1.3 segfaults) comes back as a negative returncode and
    an empty reply, never as a crash of the caller. Raises subprocess.TimeoutExpired.
    """
    proc = subprocess.run([LIBNVME_PYTHON, "-c", _LIBNVME_CHILD], input=json.dumps(request),
                          capture_output=True, text=True, timeout=timeout_s, check=False)
    try:
        reply = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else {}
    except ValueError:
        reply = {}
    return LibnvmeResult(reply if isinstance(reply, dict) else {}, proc.returncode, proc.stderr)
