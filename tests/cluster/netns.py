"""A network namespace joined to this one by a veth pair, for partition tests: ``cut()``
takes the link down (packets are dropped both ways, no reset: a partition as a switch
failure makes it), ``heal()`` brings it back. Built on :mod:`tierkv.bench.netns` (root,
the kernel's netns and veth); tests skip where those are missing."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tierkv.bench.netns import ROOT, Namespaces, NetnsError


@dataclass
class NetNs:
    nets: Namespaces
    name: str
    host_dev: str
    host_ip: str     # this side of the link
    ns_ip: str       # the namespace's side

    @property
    def exec(self) -> list[str]:
        """The command prefix that runs a process in the namespace."""
        return self.nets.exec(self.name)

    def cut(self) -> None:
        self.nets.set_up(ROOT, self.host_dev, False)

    def heal(self) -> None:
        self.nets.set_up(ROOT, self.host_dev, True)


@contextlib.contextmanager
def make_netns() -> Iterator[NetNs]:
    """A namespace and its link for the duration (pytest.skip where they cannot be made)."""
    try:
        nets = Namespaces()
    except NetnsError as exc:
        pytest.skip(str(exc))
    with nets:
        try:
            name = nets.add("n")
            (host_dev, host_ip), (_, ns_ip) = nets.link(ROOT, name)
        except NetnsError as exc:
            pytest.skip(f"cannot make a network namespace with a veth pair here: {exc}")
        yield NetNs(nets, name, host_dev, host_ip, ns_ip)
