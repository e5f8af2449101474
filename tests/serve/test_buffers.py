"""Page buffers can be given back (issue 21 review): a connection may have 64 segments
registered with the daemon, and before there was no way to free one, so a client that
took page buffers as it went was refused its 65th for good. ``release_buffer`` unmaps
one here and on every connection's daemon side; a released buffer is refused by name."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import PB, make_config
from tests.serve.pagegen import pages_of, prompt
from tierkv.errors import InputError
from tierkv.serve.client import RemoteStore
from tierkv.serve.daemon import NodeService
from tierkv.serve.segments import MAX_SEGMENTS
from tierkv.store.api import Store


@pytest.fixture
def service(tmp_path: Path, sock_dir: Path) -> Iterator[NodeService]:
    with NodeService(make_config(tmp_path / "s", dram_pages=16, nvme_pages=0), sock_dir / "d.sock").start() as svc:
        yield svc


@pytest.fixture
def client(service: NodeService) -> Iterator[RemoteStore]:
    with Store.connect(service.path) as c:
        yield c


def test_a_client_that_releases_its_buffers_may_take_any_number(service: NodeService, client: RemoteStore) -> None:
    for i in range(MAX_SEGMENTS + 16):
        buf = client.page_buffer(2)
        t = prompt(i, 2)
        buf[:] = pages_of(t)
        client.put(t, buf)
        buf[:] = 0
        assert client.get(t, buf).pages == 2 and np.array_equal(buf, pages_of(t))
        client.release_buffer(buf)
    assert service.mapped_segments == 0                # every mapping gone from the daemon too


def test_without_release_the_limit_holds(client: RemoteStore) -> None:
    t = prompt(0, 1)
    for _ in range(MAX_SEGMENTS):
        client.put(t, client.page_buffer(1))
    with pytest.raises(InputError, match=f"at most {MAX_SEGMENTS} page segments"):
        client.put(t, client.page_buffer(1))


def test_a_buffer_is_released_on_every_threads_connection(service: NodeService, client: RemoteStore) -> None:
    buf = client.page_buffer(2)
    t = prompt(1, 2)
    buf[:] = pages_of(t)
    other = threading.Thread(target=lambda: client.put(t, buf))   # registered on that thread's connection too
    other.start()
    other.join()
    client.get(t, buf)
    assert service.mapped_segments == 2
    client.release_buffer(buf)
    assert service.mapped_segments == 0


def test_a_released_buffer_is_refused_by_name(client: RemoteStore) -> None:
    buf = client.page_buffer(2)
    t = prompt(2, 2)
    buf[:] = pages_of(t)
    client.put(t, buf)
    client.release_buffer(buf)
    for use in (lambda: client.put(t, buf), lambda: client.get(t, buf), lambda: client.get(t, buf[:1]),
                lambda: client.release_buffer(buf)):
        with pytest.raises(InputError, match="released"):
            use()
    with pytest.raises(InputError, match="not a page buffer"):
        client.release_buffer(np.zeros((2, PB), np.uint8))
    out = np.zeros((2, PB), np.uint8)                 # the client goes on as before
    assert client.get(t, out).pages == 2 and np.array_equal(out, pages_of(t))


def test_a_buffer_released_while_another_thread_uses_it(service: NodeService, client: RemoteStore) -> None:
    """The other thread's calls either finish with their own pages or are refused with
    "released": none fails otherwise, and nothing stays mapped in the daemon."""
    buf = client.page_buffer(2)
    t = prompt(3, 2)
    buf[:] = pages_of(t)
    client.put(t, buf)
    started, outcome = threading.Event(), []

    def use() -> None:
        try:
            while True:
                assert client.get(t, buf).pages == 2 and np.array_equal(buf, pages_of(t))
                started.set()
        except InputError as exc:
            outcome.append(str(exc))
        except BaseException as exc:  # noqa: BLE001 - checked below
            outcome.append(repr(exc))
        started.set()

    other = threading.Thread(target=use)
    other.start()
    assert started.wait(30)
    client.release_buffer(buf)
    other.join(30)
    assert len(outcome) == 1 and "released" in outcome[0], outcome
    assert service.mapped_segments == 0


def test_attach_maps_a_buffer_before_its_first_use(service: NodeService, client: RemoteStore) -> None:
    """attach_buffer registers a page buffer on the calling thread's connection now (the
    connector does it at start, so that a request's first get does not pay for the mapping)."""
    base = service.mapped_segments
    buf = client.page_buffer(2)
    client.attach_buffer(buf)
    assert service.mapped_segments == base + 1
    t = prompt(3, 2)
    buf[:] = pages_of(t)
    client.put(t, buf)                                 # the same mapping: nothing more registered
    assert service.mapped_segments == base + 1
    client.attach_buffer(buf)                          # again: nothing to do
    assert service.mapped_segments == base + 1
    with pytest.raises(InputError, match="not a page buffer of this client"):
        client.attach_buffer(np.zeros((2, PB), np.uint8))
    client.release_buffer(buf)
    assert service.mapped_segments == base
    with pytest.raises(InputError, match="not a page buffer"):
        client.attach_buffer(buf)



def test_a_sparse_segment_is_not_populated_by_the_daemon(service: NodeService) -> None:
    """The daemon fills page tables at registration (MAP_POPULATE) only for a segment the
    client has allocated in full: populating a sparse memfd would allocate its holes in
    the daemon, so a client could spend the daemon's memory with a large empty segment."""
    import fcntl
    import os

    from tierkv.serve import protocol as P
    from tierkv.serve.client import _Conn

    conn = _Conn(str(service.path), 10.0)
    try:
        conn.call(P.Op.HELLO, b'{"version": %d, "pid": %d}' % (P.VERSION, os.getpid()))
        fd = os.memfd_create("sparse", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        size = 1 << 30                                   # 1 GiB, never touched
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        conn.call(P.Op.SEGMENT, P.SEGMENT_REQ.pack(900, size), fds=(fd,))
        assert os.fstat(fd).st_blocks == 0               # the daemon allocated none of it
        os.close(fd)
    finally:
        conn.close()
