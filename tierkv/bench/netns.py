"""Network namespaces joined by veth pairs, for benchmarks and failure tests that need real
links between node daemons on one machine (``ip netns``, ``ip link``, ``tc``; root only).

:class:`Namespaces` makes namespaces under one prefix, links any two of them (or one and
the namespace it runs in, named ``ROOT``) by a veth pair with an address on each end,
shapes a link's end with a token bucket (``tc qdisc ... tbf``: that end's egress at a
rate), takes a link down and up, and deletes everything it made on ``close``. Addresses
come from a 10.x.0.0/16 that no interface here uses yet.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from typing import Self

from tierkv.errors import ConfigError

ROOT = ""   # the namespace this process runs in
_INSTANCES = itertools.count()


class NetnsError(ConfigError):
    """Namespaces, links or shaping cannot be made here (not root, no ``ip``/``tc``, a
    kernel without netns, veth or tbf)."""


def _run(*argv: str) -> None:
    try:
        subprocess.run(argv, check=True, capture_output=True, text=True, timeout=10)
    except subprocess.CalledProcessError as exc:
        raise NetnsError(f"{' '.join(argv)} failed: {(exc.stderr or exc.stdout or '').strip()}") from None
    except (OSError, subprocess.SubprocessError) as exc:
        raise NetnsError(f"{' '.join(argv)} failed: {exc}") from None


class Namespaces:
    """Namespaces named ``{prefix}{name}`` and the links between them (a context manager)."""

    def __init__(self, prefix: str | None = None) -> None:
        if os.geteuid() != 0:
            raise NetnsError("network namespaces need root")
        missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
        if missing:
            raise NetnsError(f"{' and '.join(missing)} not found (Debian: apt-get install iproute2)")
        # Unique per instance (two in one process, or a pid reused): device names stay within 15 characters.
        self.prefix = prefix or f"tkv{os.getpid() % 10000}{next(_INSTANCES) % 100}"
        used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, timeout=10).stdout
        self.octet = next((o for o in (16 + (os.getpid() + i) % 200 for i in range(200)) if f" 10.{o}." not in used),
                          None)
        if self.octet is None:
            raise NetnsError("no free 10.x.0.0/16 for the links")
        self._names: list[str] = []
        self._devs: list[tuple[str, str]] = []   # (namespace, device) of one end of each link
        self._links = 0

    def add(self, name: str) -> str:
        """Make namespace ``name`` (its loopback up); its full name."""
        full = self.prefix + name
        self._names.append(full)   # recorded first: made by a command that then timed out, it is still deleted
        _run("ip", "netns", "add", full)
        _run("ip", "-n", full, "link", "set", "lo", "up")
        return full

    def exec(self, ns: str) -> list[str]:
        """The command prefix that runs a process in namespace ``ns`` (full name; ROOT: none)."""
        return [] if ns == ROOT else ["ip", "netns", "exec", ns]

    def link(self, a: str, b: str) -> tuple[tuple[str, str], tuple[str, str]]:
        """A veth pair between namespaces ``a`` and ``b`` (full names, or ROOT), each end
        up with an address of a /24 of its own: ((device, address) in ``a``, in ``b``)."""
        self._links += 1
        k = self._links
        if k > 250:
            raise NetnsError("at most 250 links")
        ends = []
        for i, ns in enumerate((a, b)):
            ends.append((f"{self.prefix}l{k}{'ab'[i]}"[:15], f"10.{self.octet}.{k}.{i + 1}", ns))
        self._devs.append((ROOT, ends[0][0]))   # deleting one end deletes the pair; recorded first, as above
        _run("ip", "link", "add", ends[0][0], "type", "veth", "peer", "name", ends[1][0])
        for i, (dev, ip, ns) in enumerate(ends):
            if ns != ROOT:
                _run("ip", "link", "set", dev, "netns", ns)
                if i == 0:
                    self._devs[-1] = (ns, dev)
            where = ["-n", ns] if ns != ROOT else []
            _run("ip", *where, "addr", "add", f"{ip}/24", "dev", dev)
            _run("ip", *where, "link", "set", dev, "up")
        return (ends[0][0], ends[0][1]), (ends[1][0], ends[1][1])

    def shape(self, ns: str, dev: str, mbit: float) -> None:
        """Limit what ``dev`` (in namespace ``ns``) sends to ``mbit`` Mbit/s: a token bucket
        with a burst of 128 KiB (more than one segment a veth may carry)."""
        argv = ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{mbit:g}mbit", "burst", "128kb",
                "latency", "50ms"]
        _run(*(["ip", "netns", "exec", ns] if ns != ROOT else []), *argv)

    def set_up(self, ns: str, dev: str, up: bool) -> None:
        """Take ``dev`` down (packets dropped both ways, no reset) or up again."""
        _run("ip", *(["-n", ns] if ns != ROOT else []), "link", "set", dev, "up" if up else "down")

    def close(self) -> None:
        for ns, dev in reversed(self._devs):
            subprocess.run(["ip", *(["-n", ns] if ns != ROOT else []), "link", "del", dev], capture_output=True)
        for name in reversed(self._names):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._devs, self._names = [], []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
