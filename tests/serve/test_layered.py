"""Layered gets through the daemon (GET_LAYERED): the daemon writes the pages into the
client's page buffer a layer at a time and announces each in the client's landing record,
which another thread of the client watches (the vLLM connector's loads)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import LAYOUT, PB, make_config
from tests.serve.pagegen import pages_of, prompt
from tierkv.errors import InputError
from tierkv.serve.client import RemoteStore
from tierkv.serve.daemon import NodeService
from tierkv.store import landed as L
from tierkv.store.api import Store

PER = PB // LAYOUT.num_layers


@pytest.fixture(params=[(8, 0), (2, 16)], ids=["dram", "dram+nvme"])
def service(request: pytest.FixtureRequest, tmp_path: Path, sock_dir: Path) -> Iterator[NodeService]:
    dram, nvme = request.param
    cfg = make_config(tmp_path / "s", dram_pages=dram, nvme_pages=nvme, promote_on_hit=False)
    with NodeService(cfg, sock_dir / "d.sock").start() as svc:
        yield svc


@pytest.fixture
def client(service: NodeService) -> Iterator[RemoteStore]:
    with Store.connect(service.path) as c:
        yield c


def test_a_layered_get_lands_the_same_pages_as_a_get(client: RemoteStore) -> None:
    t = prompt(1, 6)
    client.put(t, pages_of(t))
    buf, rec = client.page_buffer(7), client.landing_record()
    plain = np.zeros((6, PB), dtype=np.uint8)
    assert client.get(t, plain).pages == 6
    for _ in range(2):   # the record is reset by each get
        buf[:] = 0
        got = client.get(t, buf[:6], landed=rec)
        assert got.pages == 6 and np.array_equal(buf[:6], plain) and np.array_equal(buf[:6], pages_of(t))
        assert (L.read(rec, L.PAGES), L.read(rec, L.LAYERS)) == (6, LAYOUT.num_layers)
    longer = prompt(1, 7)   # one page more than the store holds: 6 announced, 6 served
    assert client.get(longer, buf, landed=rec).pages == 6
    assert L.read(rec, L.PAGES) == 6


def test_a_watcher_never_sees_a_layer_announced_before_its_bytes(client: RemoteStore) -> None:
    t = prompt(2, 8)
    want = pages_of(t)
    client.put(t, want)
    buf, rec = client.page_buffer(8), client.landing_record()
    wrong: list[str] = []
    seen: set[int] = set()
    for _ in range(20):
        buf[:] = 0
        L.reset(rec)
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                layers = L.read(rec, L.LAYERS)
                pages = L.read(rec, L.PAGES)
                if layers:
                    seen.add(layers)
                    if not np.array_equal(buf[:pages, :layers * PER], want[:pages, :layers * PER]):
                        wrong.append(f"{layers} layers announced, their bytes not all there")

        w = threading.Thread(target=watch)
        w.start()
        try:
            assert client.get(t, buf, landed=rec).pages == 8
        finally:
            stop.set()
            w.join()
    assert not wrong, wrong[:3]
    assert LAYOUT.num_layers in seen


def test_a_layered_get_needs_shared_memory_for_its_pages_and_record(client: RemoteStore) -> None:
    t = prompt(3, 2)
    client.put(t, pages_of(t))
    buf, rec = client.page_buffer(2), client.landing_record()
    with pytest.raises(InputError, match="landing_record"):
        client.get(t, buf, landed=L.new_record())      # the record in this process only
    with pytest.raises(InputError, match="page_buffer"):
        client.get(t, np.zeros((2, PB), dtype=np.uint8), landed=rec)
    with pytest.raises(InputError, match="landing record"):
        client.get(t, buf, landed=np.zeros(2, dtype=np.int64))
    client.release_buffer(rec)
    with pytest.raises(InputError, match="released"):
        client.get(t, buf, landed=rec)


def test_a_thread_that_only_attached_its_buffers_gets_after_a_daemon_restart(tmp_path: Path,
                                                                             sock_dir: Path) -> None:
    """Review (bench vllm): the connector's loader thread attaches its buffers, and its
    first get may come after the daemon restarted; so may the main thread's first put,
    on the connection that only greeted the daemon. Both connections had served (the
    greeting counts), so each call connects again and is sent again instead of failing
    (which made vLLM recompute the load)."""
    cfg = make_config(tmp_path / "s", dram_pages=8)
    path = sock_dir / "r.sock"
    t = prompt(5, 4)
    svc = NodeService(cfg, path).start()
    client = Store.connect(path)
    buf, rec = client.page_buffer(4), client.landing_record()
    out: list[object] = []

    def attach_then_get(go: threading.Event) -> None:
        client.attach_buffer(buf)
        client.attach_buffer(rec)
        go.wait(30)
        try:
            out.append(client.get(t, buf, landed=rec).pages)
        except Exception as exc:  # noqa: BLE001 - reported below
            out.append(exc)

    go = threading.Event()
    th = threading.Thread(target=attach_then_get, args=(go,))
    th.start()
    while len(getattr(client._mine.get(th.ident or 0), "registered", ())) < 2:   # until both are attached
        threading.Event().wait(0.01)
    svc.close()
    svc = NodeService(cfg, path).start()
    client.put(t, pages_of(t))
    go.set()
    th.join(30)
    try:
        assert out == [4] and np.array_equal(buf, pages_of(t))
    finally:
        client.close()
        svc.close()
