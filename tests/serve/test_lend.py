"""Pages lent in place (DRAM_POOL, LEND, END_LEND): a client maps the daemon's DRAM tier
read-only and copies pages straight out of it, the rows held for it until it ends the lend
or its connection ends."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import PB, make_config
from tierkv.config import ServeConfig
from tests.serve.pagegen import pages_of, prompt
from tierkv.errors import ConfigError, InputError
from tierkv.serve.client import RemoteStore
from tierkv.serve.daemon import NodeService
from tierkv.store.api import Store
from tierkv.tiers.base import TierKind


@pytest.fixture
def service(tmp_path: Path, sock_dir: Path) -> Iterator[NodeService]:
    # Lends of the whole (4-page) DRAM tier: the cap on lent rows has its own test.
    cfg = make_config(tmp_path / "s", dram_pages=4, nvme_pages=16, promote_on_hit=False,
                      serve=ServeConfig(max_lent_fraction=1.0))
    with NodeService(cfg, sock_dir / "d.sock").start() as svc:
        yield svc


@pytest.fixture
def client(service: NodeService) -> Iterator[RemoteStore]:
    with Store.connect(service.path) as c:
        yield c


def test_lent_rows_hold_the_pages_until_the_lend_ends(service: NodeService, client: RemoteStore) -> None:
    t = prompt(1, 3)
    client.put(t, pages_of(t))
    pool = client.dram_pool()
    assert pool.shape[1] == PB and not pool.flags.writeable
    lent = client.lend(t, want=3)
    assert (lent.pages, lent.tokens) == (3, 3 * 16)
    want = pages_of(t)
    assert all(np.array_equal(pool[s], want[i]) for i, s in enumerate(lent.slots))
    for k in range(3):   # other prompts push these pages out of DRAM: their rows wait for the lend
        other = prompt(10 + k, 4)
        client.put(other, pages_of(other))
    assert all(np.array_equal(pool[s], want[i]) for i, s in enumerate(lent.slots))
    assert service.store.lookup(t).tiers[0] is TierKind.NVME
    client.end_lend(lent)
    with pytest.raises(InputError, match="not open"):
        client.end_lend(lent)
    assert client.lend(t, want=3).pages == 0   # in NVMe now: nothing to lend (a get serves them)


def test_a_connections_lends_end_with_it(service: NodeService, client: RemoteStore) -> None:
    t = prompt(2, 2)
    client.put(t, pages_of(t))
    other = Store.connect(service.path)
    lent = other.lend(t, want=2)
    assert lent.pages == 2
    other.close()   # without end_lend: the daemon ends it when the connection goes
    deadline = threading.Event()
    for _ in range(100):
        if service.store._copying == 0:
            break
        deadline.wait(0.02)
    assert service.store._copying == 0


def test_a_lend_ends_only_on_the_thread_that_took_it(client: RemoteStore) -> None:
    t = prompt(3, 1)
    client.put(t, pages_of(t))
    lent = client.lend(t, want=1)
    errors: list[BaseException] = []

    def elsewhere() -> None:
        try:
            client.end_lend(lent)
        except InputError as exc:
            errors.append(exc)

    th = threading.Thread(target=elsewhere)
    th.start()
    th.join()
    assert errors and "thread that took it" in str(errors[0])
    client.end_lend(lent)


def test_a_user_limited_to_some_tenants_is_not_lent_the_pool(tmp_path: Path, sock_dir: Path) -> None:
    from tierkv.config import ServeConfig
    from tierkv.errors import AccessDeniedError

    import dataclasses

    cfg = dataclasses.replace(make_config(tmp_path / "s", 4, 0), serve=ServeConfig(tenants={str(os.getuid()): ("alpha",)}))
    with NodeService(cfg, sock_dir / "t.sock").start() as svc, Store.connect(svc.path) as c:
        with pytest.raises(AccessDeniedError, match="every tenant"):
            c.dram_pool()
        with pytest.raises(AccessDeniedError, match="every tenant"):
            c.lend(prompt(4, 1), "alpha", want=1)


def test_after_a_daemon_restart_lent_rows_are_read_from_the_new_pool(tmp_path: Path, sock_dir: Path) -> None:
    # The client keeps its mapping of the first daemon's pool; a lend from the second
    # names rows of another buffer: the client maps that one before anyone reads them.
    t = prompt(5, 2)
    other = prompt(6, 3)
    path = sock_dir / "r.sock"
    cfg = make_config(tmp_path / "a", dram_pages=8, nvme_pages=0)
    with NodeService(cfg, path).start():
        c = Store.connect(path)
        c.put(t, pages_of(t))
        first = c.dram_pool()
        c.end_lend(c.lend(t, want=2))
    cfg_b = make_config(tmp_path / "b", dram_pages=8, nvme_pages=0)
    with NodeService(cfg_b, path).start():
        c.put(other, pages_of(other))          # rows 0-2 of the new pool: another prompt's pages
        c.put(t, pages_of(t))                  # t's pages on rows 3-4 here (rows 0-1 in the old pool)
        lent = c.lend(t, want=2)
        assert lent.pages == 2 and lent.pool != 0
        pool = c.dram_pool()
        assert pool is not first
        assert all(np.array_equal(pool[s], pages_of(t)[i]) for i, s in enumerate(lent.slots))
        c.end_lend(lent)
        c.close()


def test_a_connection_holds_at_most_its_share_of_the_dram_rows_lent(tmp_path: Path, sock_dir: Path) -> None:
    """Rows lent for pages evicted meanwhile are withheld from reuse until the lend ends:
    one connection may hold serve.max_lent_fraction of the DRAM tier lent at once. A
    whole lend past it lends nothing (and counts nothing: the client gets instead), a
    partial one what fits; another connection has a share of its own."""
    cfg = make_config(tmp_path / "s", dram_pages=8, nvme_pages=16, serve=ServeConfig(max_lent_fraction=0.5))
    with NodeService(cfg, sock_dir / "c.sock").start() as svc, Store.connect(svc.path) as client:
        t = prompt(20, 6)
        client.put(t, pages_of(t))
        first = client.lend(t, want=3, whole=True)                 # 3 of the 4 rows this connection may hold
        assert first.pages == 3
        before = svc.store.stats().pages_requested
        assert client.lend(t, want=2, whole=True).pages == 0       # 5 > 4: nothing
        assert svc.store.stats().pages_requested == before         # and nothing counted
        part = client.lend(t, want=2)                              # not whole: the 1 row left
        assert part.pages == 1
        assert client.lend(t, want=1).pages == 0                   # none left
        with Store.connect(svc.path) as other:                     # another connection: its own share
            assert other.lend(t, want=4, whole=True).pages == 4
        client.end_lend(first)
        client.end_lend(part)
        again = client.lend(t, want=4, whole=True)
        assert again.pages == 4
        client.end_lend(again)


def test_max_lent_fraction_is_checked() -> None:
    for bad in (0, 1.5, -0.1, "half"):
        with pytest.raises(ConfigError, match="serve.max_lent_fraction"):
            ServeConfig(max_lent_fraction=bad)  # type: ignore[arg-type]


def test_a_lend_of_a_restarted_daemons_pool_is_not_ended_on_the_new_one(tmp_path: Path, sock_dir: Path) -> None:
    """Review: lend tokens started again from 0 in a new daemon, so a thread's old lend
    (ended with its connection when the daemon went) could end the new daemon's lend of
    the same number, whose rows the thread may still be reading. Tokens start at random
    per DRAM tier now: the old one names no lend there."""
    cfg = make_config(tmp_path / "s", dram_pages=4, nvme_pages=16, serve=ServeConfig(max_lent_fraction=1.0))
    path = sock_dir / "r.sock"
    t = prompt(30, 2)
    svc = NodeService(cfg, path).start()
    client = Store.connect(path)
    client.put(t, pages_of(t))
    client.dram_pool()
    old = client.lend(t, want=2, whole=True)
    svc.close()
    svc = NodeService(cfg, path).start()                   # a new daemon, a new pool, tokens from 0 again
    other = prompt(31, 2)
    client.put(other, pages_of(other))
    new = client.lend(other, want=2, whole=True)
    try:
        assert new.pages == 2 and new.pool != old.pool and new.token != old.token
        with pytest.raises(InputError, match="not open"):
            client.end_lend(old)                           # ended with its daemon: nothing to end here
        assert svc.store._fast is not None and svc.store._fast.lent(new.token)
        client.end_lend(new)
        assert not svc.store._fast.lent(new.token)
    finally:
        client.close()
        svc.close()
