"""A real etcd per test (``etcd`` from Debian's etcd-server, on loopback, stopped by PID)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

from tierkv.cluster.local import LocalEtcd, etcd_binary
from tests.cluster.netns import NetNs, make_netns


#: For tests that start their own etcd (a LocalCluster): skipped where it cannot run.
needs_etcd = pytest.mark.skipif(etcd_binary() is None or importlib.util.find_spec("etcd3gw") is None,
                                reason="needs the etcd server and etcd3gw (tools/install.sh installs both)")


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[LocalEtcd]:
    if etcd_binary() is None:
        pytest.skip("needs the etcd server: apt-get install etcd-server (tools/install.sh does)")
    if importlib.util.find_spec("etcd3gw") is None:
        pytest.skip("needs etcd3gw: pip install 'tierkv[cluster]' (tools/install.sh does)")
    server = LocalEtcd(tmp_path / "etcd").start()
    yield server
    server.stop()


@pytest.fixture
def netns() -> Iterator[NetNs]:
    """A network namespace joined to this one by a veth pair (tests/cluster/netns.py)."""
    with make_netns() as ns:
        yield ns
