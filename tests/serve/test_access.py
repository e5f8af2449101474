"""Tenants tied to connections by the peer's user (SO_PEERCRED): client processes run as
other users (``nobody``, an unnamed uid) against a daemon that names what each may use."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import PB, make_config
from tests.serve.pagegen import pages_of, prompt
from tierkv.config import ServeConfig, config_from_dict
from tierkv.errors import AccessDeniedError, ConfigError
from tierkv.serve.daemon import NodeService
from tierkv.store.api import Store

NOBODY = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="runs clients as other users: needs root")


def as_user(uid: int, fn: Callable[[], str]) -> str:
    """Run ``fn`` in a forked child that has become ``uid`` (this interpreter is in root's
    home, which other users cannot exec); returns what it returned, or raises what it raised."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: no pytest machinery from here on
        os.close(r)
        code = 0
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            out = "ok:" + fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            out, code = f"raised:{type(exc).__name__}:{exc}", 1
        os.write(w, out.encode())
        os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    os.waitpid(pid, 0)
    if not out.startswith("ok:"):
        raise AssertionError(f"the client as uid {uid} {out}")
    return out[3:]


@pytest.fixture
def service(tmp_path: Path, sock_dir: Path) -> Iterator[NodeService]:
    os.chmod(sock_dir, 0o755)
    cfg = replace(make_config(tmp_path / "s", 8, 16),
                  serve=ServeConfig(mode="0666", tenants={"nobody": ("acme", ""), "root": ("*",)}))
    svc = NodeService(cfg, sock_dir / "d.sock").start()
    yield svc
    svc.close()


def test_a_user_uses_only_the_tenants_it_is_given(service: NodeService) -> None:
    root = Store.connect(service.path)
    try:
        t = prompt(1, 2)
        for tenant in ("acme", "globex", ""):
            assert root.put(t, pages_of(t), tenant).stored == 2          # root: "*"
        def nobody() -> str:
            with Store.connect(service.path) as s:
                out = np.zeros((2, PB), np.uint8)
                assert s.get(t, out, "acme").pages == 2 and np.array_equal(out, pages_of(t))
                assert s.lookup(t, "").cached_pages == 2
                assert s.origins(t, "acme") == []   # its own tenant's: none derived
                for call in (lambda: s.lookup(t, "globex"), lambda: s.get(t, out, "globex"),
                             lambda: s.put(t, pages_of(t), "globex"), lambda: s.pin(t, "globex"),
                             lambda: s.prefetch(t, b"globex").result(), lambda: s.origins(t, "globex")):
                    with pytest.raises(AccessDeniedError, match="may not use tenant 'globex'"):
                        call()
                long = np.concatenate([t, np.arange(10_000)])   # past the inline limit: through the token segment
                assert s.lookup(long, "acme").cached_pages == 2
                return str(s.lookup(t, "acme").cached_pages)
        assert as_user(NOBODY, nobody) == "2"
        assert root.stats().lookups == 3   # the refused lookups never reached the store
    finally:
        root.close()


def test_a_user_the_map_does_not_name_is_refused(service: NodeService) -> None:
    def stranger() -> str:
        with pytest.raises(AccessDeniedError) as exc:
            Store.connect(service.path)
        return str(exc.value)
    assert "uid 4242) may use no tenant of this store" in as_user(4242, stranger)


def test_serve_settings_are_checked(tmp_path: Path, sock_dir: Path) -> None:
    base = {"store": {"path": str(tmp_path / "s"), "model_id": "m"},
            "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64},
            "tiers": {"dram": {"capacity_bytes": 8 * PB}}}
    for serve, match in (({"mode": 600}, "octal permission bits as text"), ({"mode": "0999"}, "octal"),
                         ({"tenants": {"nobody": "acme"}}, "maps to a list of tenant names"),
                         ({"max_clients": 0}, "max_clients"), ({"sockets": "x"}, "unknown key")):
        with pytest.raises(ConfigError, match=match):
            config_from_dict({**base, "serve": serve})
    cfg = config_from_dict({**base, "serve": {"tenants": {"no-such-user-here": ["a"]}, "socket": str(sock_dir / "x")}})
    with pytest.raises(ConfigError, match="which this system does not have"):
        NodeService(cfg)
    cfg = config_from_dict({**base, "serve": {"socket": str(sock_dir / "c.sock"), "mode": "0640"}})
    with NodeService(cfg).start() as svc:   # the socket and its mode from [serve]
        assert svc.path == sock_dir / "c.sock" and (svc.path.stat().st_mode & 0o777) == 0o640
        with Store.connect(svc.path) as c:
            assert c.lookup(np.arange(32)).total_pages == 2
