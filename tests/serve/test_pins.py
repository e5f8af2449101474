"""Pins taken through the node service belong to the connection that took them (issue 21
review): a connection's unpin, and its end, release only its own pins, never another
client's pin on the same prompt."""

from __future__ import annotations

from collections.abc import Iterator
import threading
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import make_config
from tests.polling import wait_for
from tests.serve.pagegen import TPP, pages_of, prompt
from tierkv.serve.client import RemoteStore
from tierkv.serve.daemon import NodeService
from tierkv.store.api import Store


@pytest.fixture
def service(tmp_path: Path, sock_dir: Path) -> Iterator[NodeService]:
    """A DRAM-only store of 12 pages (evicted pages are gone), LRU."""
    with NodeService(make_config(tmp_path / "s", dram_pages=12, nvme_pages=0, policy="lru"),
                     sock_dir / "d.sock").start() as svc:
        yield svc


def pressure(client: RemoteStore, rounds: int = 6) -> None:
    """Puts of other prompts that evict every page no pin holds."""
    for i in range(rounds):
        t = prompt(100 + i, 4)
        client.put(t, pages_of(t))


def pin_both(service: NodeService) -> tuple[RemoteStore, RemoteStore, np.ndarray]:
    """Client a pins the 8-page prompt while 4 of its pages are cached; client b, once all
    8 are, pins it too. Returns (a, b, tokens)."""
    tokens = prompt(1, 8)
    a, b = Store.connect(service.path), Store.connect(service.path)
    b.put(tokens[:4 * TPP], pages_of(tokens[:4 * TPP]))
    assert a.pin(tokens) == 4
    b.put(tokens, pages_of(tokens))
    assert b.pin(tokens) == 8
    return a, b, tokens


def test_a_connection_ending_releases_only_its_own_pins(service: NodeService) -> None:
    a, b, tokens = pin_both(service)
    a.close()
    assert wait_for(lambda: service.clients == 1, 10)
    pressure(b)
    assert b.lookup(tokens).cached_pages == 8
    assert b.unpin(tokens) == 8
    pressure(b)
    assert b.lookup(tokens).cached_pages == 0
    b.close()


def test_a_connections_unpin_releases_its_own_pin(service: NodeService) -> None:
    a, b, tokens = pin_both(service)
    assert a.unpin(tokens) == 4
    assert a.unpin(tokens) == 0
    pressure(b)
    assert b.lookup(tokens).cached_pages == 8
    a.close()
    b.close()


def test_a_clients_pins_are_its_own_on_every_thread(service: NodeService) -> None:
    """A client has a connection per thread; its pins are the client's, as an in-process
    store's are its caller's: taken on one thread, released by an unpin on another, and
    kept while the client lives after the thread that took them has ended."""
    tokens = prompt(2, 4)
    client = Store.connect(service.path)
    client.put(tokens, pages_of(tokens))
    taken: list[int] = []

    def pin_and_hang_up() -> None:
        taken.append(client.pin(tokens))
        client._drop(client._mine[threading.get_ident()])   # as the client does for threads that ended

    t = threading.Thread(target=pin_and_hang_up)
    t.start()
    t.join()
    assert taken == [4]
    assert wait_for(lambda: [n for _, n in service._sessions.values()] == [1], 10)   # this thread's only
    pressure(client)
    assert client.lookup(tokens).cached_pages == 4
    assert client.unpin(tokens) == 4
    client.pin(tokens)
    client.close()                                     # its last connection: its pins go
    assert wait_for(lambda: service.clients == 0, 10)
    assert service.store.release_pins(0) == 0 and not service._sessions
    with Store.connect(service.path) as other:
        pressure(other)
        assert other.lookup(tokens).cached_pages == 0
