"""A network namespace joined to this one by a veth pair, for partition tests: ``cut()``
takes the link down (packets are dropped both ways, no reset: a partition as a switch
failure makes it), ``heal()`` brings it back. Needs root and the kernel's netns and veth;
tests skip where either is missing."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@dataclass
class NetNs:
    name: str
    host_dev: str
    host_ip: str     # this side of the link
    ns_ip: str       # the namespace's side

    @property
    def exec(self) -> list[str]:
        """The command prefix that runs a process in the namespace."""
        return ["ip", "netns", "exec", self.name]

    def cut(self) -> None:
        _ip("link", "set", self.host_dev, "down")

    def heal(self) -> None:
        _ip("link", "set", self.host_dev, "up")


@contextlib.contextmanager
def make_netns() -> Iterator[NetNs]:
    """A namespace and its link for the duration (pytest.skip where they cannot be made)."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    tag = f"tkv{os.getpid() % 100000}"
    used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, timeout=10).stdout
    octet = next(o for o in [16 + (os.getpid() + i) % 200 for i in range(200)] if f" 10.{o}." not in used)
    ns = NetNs(tag, f"{tag}h", f"10.{octet}.0.1", f"10.{octet}.0.2")
    try:
        _ip("netns", "add", ns.name)
        _ip("link", "add", ns.host_dev, "type", "veth", "peer", "name", f"{tag}n")
        _ip("link", "set", f"{tag}n", "netns", ns.name)
        _ip("addr", "add", f"{ns.host_ip}/24", "dev", ns.host_dev)
        _ip("link", "set", ns.host_dev, "up")
        _ip("-n", ns.name, "addr", "add", f"{ns.ns_ip}/24", "dev", f"{tag}n")
        _ip("-n", ns.name, "link", "set", f"{tag}n", "up")
        _ip("-n", ns.name, "link", "set", "lo", "up")
    except (OSError, subprocess.SubprocessError) as exc:
        _clean(ns)
        pytest.skip(f"cannot make a network namespace with a veth pair here: {exc}")
    try:
        yield ns
    finally:
        _clean(ns)


def _clean(ns: NetNs) -> None:
    subprocess.run(["ip", "link", "del", ns.host_dev], capture_output=True)
    subprocess.run(["ip", "netns", "del", ns.name], capture_output=True)
