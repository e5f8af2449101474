"""Fixtures for the node service: a store opened in-process or served by a daemon thread
(`NodeService`) and reached through `Store.connect`, behind one factory."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Union

import pytest

from tierkv.config import StoreConfig
from tierkv.serve.client import RemoteStore
from tierkv.serve.daemon import NodeService
import tierkv.store.api as api
from tierkv.store.api import Store

AnyStore = Union[Store, RemoteStore]
Opener = Callable[[StoreConfig], AnyStore]

BACKENDS = ("in-process", "connected")


class Opened:
    """Opens stores on one backend and closes all of them, clients before daemons."""

    def __init__(self, backend: str, sock_dir: Path) -> None:
        self.backend = backend
        self._dir = sock_dir
        self._made: list[AnyStore | NodeService] = []
        self.services: list[NodeService] = []

    def __call__(self, cfg: StoreConfig) -> AnyStore:
        if self.backend == "in-process":
            s = Store.open(cfg)
            self._made.append(s)
            return s
        svc = NodeService(cfg, self._dir / f"s{len(self.services)}.sock").start()
        self._made.append(svc)
        self.services.append(svc)
        client = Store.connect(svc.path, timeout_s=30)
        self._made.append(client)
        return client

    def close(self) -> None:
        for m in reversed(self._made):
            m.close()


@pytest.fixture(autouse=True)
def every_copy_unlocked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Copies into and out of DRAM run without the store's lock from 1 MiB up; the pages
    here are 16 KiB, so make every one do, in-process and in daemon threads alike."""
    monkeypatch.setattr(api, "UNLOCKED_COPY_BYTES", 0)


@pytest.fixture(params=BACKENDS)
def opened(request: pytest.FixtureRequest, sock_dir: Path) -> Iterator[Opened]:
    o = Opened(request.param, sock_dir)
    yield o
    o.close()
