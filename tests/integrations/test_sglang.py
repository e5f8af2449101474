"""tierkv as SGLang's HiCache L3 storage (tierkv/integrations/sglang.py), created by SGLang's own
dynamic backend factory from its own ``HiCacheStorageConfig``, over real stores: in-process
(a DRAM tier over an O_DIRECT NVMe file) and through a ``tierkv serve`` daemon. Page keys are
chained sha256 digests in SGLang's form (64 hex digits per page, each over its parent's
digest and the page's tokens). SGLang's own ``get_hash_str`` is not used: it compiles a
C++ extension at first use (g++, OpenSSL headers) and fails once another test has
imported the standard library's distutils; the backend treats keys as opaque strings.

The host pool: SGLang's pool classes (``pool_host/mha.py``, ``pool_host/mla.py``) cannot be
imported with only what ``hicache_storage`` needs (their package imports torchvision and the
model configs). :class:`HostPool` therefore runs their page code taken from the installed
source with ``ast``: ``init_kv_buffer`` (the buffer's shape per layout), ``get_data_page``,
``set_from_flat_data_page`` and ``get_dummy_flat_data_page``, so buffer shapes and page
addressing are SGLang's, not a copy written here.
"""

from __future__ import annotations

import ast
import collections
import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

hs = pytest.importorskip("sglang.srt.mem_cache.hicache_storage",
                         reason="needs sglang 0.5.23: pip install --no-deps sglang==0.5.23 && pip install pybase64 "
                                "triton starlette msgspec pyzmq aiohttp")

from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from tierkv.errors import ConfigError, InputError, LayoutError  # noqa: E402
from tierkv.integrations.sglang import TierKVHiCacheStorage  # noqa: E402
from tierkv.layout import KVLayout  # noqa: E402
from tierkv.serve.daemon import NodeService  # noqa: E402
from tierkv.config import load_config  # noqa: E402

T = 16          # tokens per page (SGLang's --page-size)
POOL_PAGES = 8  # host pool pages
MHA = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="bf16", tokens_per_page=T)       # 16 KiB pages
MLA = KVLayout(num_layers=2, num_kv_heads=1, head_dim=128, dtype="bf16", tokens_per_page=T, kind="latent")  # 8 KiB
_METHODS = ("init_kv_buffer", "get_data_page", "set_from_flat_data_page", "get_dummy_flat_data_page",
            "_storage_page_index")


def sglang_methods(source: str, cls: str) -> dict[str, Callable[..., Any]]:
    """The page methods of SGLang's class ``cls`` in ``pool_host/<source>``, compiled from its source."""
    path = Path(hs.__file__).parent / "pool_host" / source
    tree = ast.parse(path.read_text())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    fns = [n for n in body if isinstance(n, ast.FunctionDef) and n.name in _METHODS]
    assert {"init_kv_buffer", "get_data_page", "set_from_flat_data_page"} <= {f.name for f in fns}

    def alloc(dims: tuple[int, ...], *, dtype: torch.dtype, device: str, **_: object) -> torch.Tensor:
        return torch.zeros(dims, dtype=dtype, device=device)

    scope: dict[str, Any] = {"torch": torch, "ALLOC_MEMORY_FUNCS": collections.defaultdict(lambda: alloc),
                             "_is_npu": False}
    exec(compile(ast.Module(body=[*fns], type_ignores=[]), str(path), "exec"), scope)
    return {f.name: scope[f.name] for f in fns}


_MHA_METHODS = sglang_methods("mha.py", "MHATokenToKVPoolHost")
_MLA_METHODS = sglang_methods("mla.py", "MLATokenToKVPoolHost")


class HostPool:
    """An SGLang host KV pool of ``POOL_PAGES`` pages in ``layout``, on SGLang's page code."""

    def __init__(self, mla: bool, layout: str, kv: KVLayout, page_size: int = T) -> None:
        self.layout, self.dtype, self.page_size, self.layer_num = layout, torch.bfloat16, page_size, kv.num_layers
        self.page_num, self.size = POOL_PAGES, POOL_PAGES * page_size
        self.device, self.pin_memory, self.allocator, self._transfer_device = "cpu", False, None, torch.device("cpu")
        if mla:
            self.kv_cache_dim, self.dcp_size = kv.head_dim, 1
        else:
            self.head_num, self.head_dim, self.v_head_dim = kv.num_kv_heads, kv.head_dim, kv.head_dim
        self._m = _MLA_METHODS if mla else _MHA_METHODS
        self.kv_buffer = self._m["init_kv_buffer"](self)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return self._m["get_data_page"](self, index, flat)  # type: ignore[no-any-return]

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self._m["set_from_flat_data_page"](self, index, data_page)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return self._m["get_dummy_flat_data_page"](self)  # type: ignore[no-any-return]

    def _storage_page_index(self, index: int) -> int:
        return self._m["_storage_page_index"](self, index)  # type: ignore[no-any-return]

    def fill(self, page: int, seed: int) -> torch.Tensor:
        """Random bytes into host page ``page``; returns a copy of them."""
        g = torch.Generator().manual_seed(seed)
        data = torch.randn(self.get_data_page(page * T).numel(), generator=g).to(self.dtype)
        self.set_from_flat_data_page(page * T, data)
        return data

    def page(self, page: int) -> torch.Tensor:
        return self.get_data_page(page * T).clone()


def indices(pages: list[int]) -> torch.Tensor:
    """SGLang's host indices of these host pages: every token slot of each."""
    return torch.tensor([p * T + t for p in pages for t in range(T)], dtype=torch.int64)


def sglang_keys(n: int, seed: int = 0) -> list[str]:
    """Page keys of an ``n``-page prompt in SGLang's form: chained sha256 digests of its tokens."""
    keys, parent = [], b""
    for i in range(n):
        tokens = b"".join(t.to_bytes(4, "little") for t in range(seed + i * T, seed + (i + 1) * T))
        digest = hashlib.sha256(parent + tokens).digest()
        keys.append(digest.hex())
        parent = digest
    return keys


def write_config(where: Path, kv: KVLayout, dram_pages: int = 4, nvme_pages: int = 32) -> Path:
    """A store config (TOML) with a DRAM tier over an NVMe file in ``where``."""
    where.mkdir(parents=True, exist_ok=True)
    path = where / "store.toml"
    path.write_text(f"""[store]
path = "{where / 'store'}"
model_id = "test-model"
[layout]
num_layers = {kv.num_layers}
num_kv_heads = {kv.num_kv_heads}
head_dim = {kv.head_dim}
dtype = "{kv.dtype.value}"
tokens_per_page = {kv.tokens_per_page}
kind = "{kv.kind.value}"
[tiers.dram]
capacity_bytes = {dram_pages * kv.page_bytes}
[tiers.nvme]
capacity_bytes = {nvme_pages * kv.page_bytes}
""")
    return path


def storage_config(mla: bool = False, *, tp: tuple[int, int] = (0, 1), model: str = "org/model",
                   **extra: object) -> Any:
    extra = {"backend_name": "tierkv", "module_path": "tierkv.integrations.sglang",
             "class_name": "TierKVHiCacheStorage", "interface_v1": 1, **extra}
    return hs.HiCacheStorageConfig(tp_rank=tp[0], tp_size=tp[1], pp_rank=0, pp_size=1, attn_cp_rank=0,
                                   attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
                                   is_page_first_layout=True, model_name=model, extra_config=extra)


class Backends:
    """Backends made as SGLang makes them (factory, then ``register_mem_pool_host``); closes them all."""

    def __init__(self) -> None:
        self.made: list[TierKVHiCacheStorage] = []

    def __call__(self, pool: HostPool, mla: bool = False, **kw: Any) -> TierKVHiCacheStorage:
        cfg = storage_config(mla, **kw)
        backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
        assert isinstance(backend, TierKVHiCacheStorage) and isinstance(backend, hs.HiCacheStorage)
        self.made.append(backend)
        backend.register_mem_pool_host(pool)
        return backend


@pytest.fixture
def backends() -> Iterator[Backends]:
    b = Backends()
    yield b
    for backend in b.made:
        backend.close()


LAYOUTS = [(False, "layer_first"), (False, "page_first"), (False, "page_first_direct"), (False, "page_head"),
           (True, "layer_first"), (True, "page_first"), (True, "page_first_direct")]


@pytest.mark.parametrize(("mla", "layout"), LAYOUTS, ids=[f"{'mla' if m else 'mha'}-{x}" for m, x in LAYOUTS])
def test_pages_round_trip_through_the_host_pool(mla: bool, layout: str, tmp_path: Path, backends: Backends) -> None:
    kv = MLA if mla else MHA
    pool = HostPool(mla, layout, kv)
    backend = backends(pool, mla, tierkv_config=str(write_config(tmp_path, kv)))
    # In place wherever a page is one contiguous view of the pool: MLA's page-first layouts.
    assert backend._zero_copy == (mla and layout != "layer_first")
    keys = sglang_keys(3)
    sent = [pool.fill(p, seed=p) for p in (5, 1, 6)]
    assert backend.batch_exists(keys) == 0
    assert backend.batch_set_v1(keys, indices([5, 1, 6])) == [True, True, True]
    for p, data in zip((5, 1, 6), sent):
        assert torch.equal(pool.page(p), data)   # the source pages are unchanged
    assert backend.batch_exists(keys) == 3 and all(backend.exists(k) for k in keys)
    assert backend.batch_get_v1(keys, indices([0, 2, 3])) == [True, True, True]
    for p, data in zip((0, 2, 3), sent):
        assert torch.equal(pool.page(p), data)
    assert not pool.page(4).any() and not pool.page(7).any()   # pages not targeted stay as they were


def test_misses_and_leading_hits(tmp_path: Path, backends: Backends) -> None:
    pool = HostPool(False, "page_first", MHA)
    backend = backends(pool, tierkv_config=str(write_config(tmp_path, MHA)))
    keys = sglang_keys(4)
    for p in range(4):
        pool.fill(p, seed=10 + p)
    assert backend.batch_set_v1([keys[0], keys[1], keys[3]], indices([0, 1, 3])) == [True, True, True]
    assert not backend.exists(keys[2]) and backend.get(keys[2], pool.get_dummy_flat_data_page()) is None
    assert backend.batch_exists(keys) == 2        # leading hits only: keys[3] is held but follows a miss
    assert backend.batch_exists(keys[2:]) == 0
    assert backend.batch_get_v1(keys, indices([4, 5, 6, 7])) == [True, True, False, False]
    assert torch.equal(pool.page(4), pool.page(0)) and torch.equal(pool.page(5), pool.page(1))
    assert not pool.page(7).any()                 # nothing is read after the first miss


def test_storing_a_stored_key_changes_nothing(tmp_path: Path, backends: Backends) -> None:
    pool = HostPool(False, "page_first", MHA)
    backend = backends(pool, tierkv_config=str(write_config(tmp_path, MHA)))
    key = sglang_keys(1)
    first = pool.fill(0, seed=1)
    assert backend.batch_set_v1(key, indices([0])) == [True]
    stored = backend.store.stats().pages_stored
    other = pool.fill(1, seed=2)
    assert backend.batch_set_v1(key, indices([1])) == [True]
    assert backend.set(key[0], other) is True
    assert backend.store.stats().pages_stored == stored
    out = backend.get(key[0], pool.get_dummy_flat_data_page())
    assert out is not None and torch.equal(out, first)


def test_the_tensor_calls_round_trip(tmp_path: Path, backends: Backends) -> None:
    """``set``/``get``/``batch_set``/``batch_get``: SGLang's path without ``interface_v1``."""
    pool = HostPool(False, "layer_first", MHA)
    backend = backends(pool, tierkv_config=str(write_config(tmp_path, MHA)))
    keys = sglang_keys(2, seed=7)
    pages = [pool.fill(0, seed=3), pool.fill(1, seed=4)]
    assert backend.batch_set(keys, [pool.get_data_page(0), pool.get_data_page(T)]) is True
    got = backend.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
    assert all(torch.equal(g, p) for g, p in zip(got, pages))
    raw = backend.get(keys[0])   # no target: the page's raw bytes
    assert raw is not None and torch.equal(raw, pages[0].view(torch.uint8))
    with pytest.raises(InputError, match="a page is 16384 bytes, got 8192"):
        backend.set("k", torch.zeros(4096, dtype=torch.bfloat16))


def test_a_store_of_another_layout_is_refused(tmp_path: Path) -> None:
    """Every mismatch names what the store holds and what SGLang's pool expects."""
    config = str(write_config(tmp_path, MHA))
    cases = [(HostPool(False, "page_first", MHA, page_size=8), "tokens_per_page=8"),
             (HostPool(False, "page_first", KVLayout(2, 4, 64, "bf16", T)), "num_kv_heads=4"),
             (HostPool(True, "page_first", MLA), "kind=<LayoutKind.LATENT")]
    for pool, expected in cases:
        backend = StorageBackendFactory.create_backend("dynamic", storage_config(tierkv_config=config), pool)
        try:
            with pytest.raises(LayoutError, match="SGLang's host pool") as err:
                backend.register_mem_pool_host(pool)
            assert expected in str(err.value) and "tokens_per_page=16" in str(err.value)
            with pytest.raises(InputError, match="register_mem_pool_host"):
                backend.batch_exists(["k"])
        finally:
            backend.close()


def test_bad_extra_config_and_calls_are_refused(tmp_path: Path, backends: Backends) -> None:
    pool = HostPool(False, "page_first", MHA)
    config = str(write_config(tmp_path, MHA))
    cases: list[tuple[dict[str, Any], str]] = [
        ({}, "exactly one of tierkv_socket"),
        ({"tierkv_config": config, "tierkv_socket": "/x.sock"}, "exactly one"),
        ({"tierkv_config": config, "tierkv_tennant": "a"}, "unknown tierkv keys.*tierkv_tennant")]
    for extra, message in cases:
        with pytest.raises(ConfigError, match=message):
            StorageBackendFactory.create_backend("dynamic", storage_config(**extra), pool)
    backend = backends(pool, tierkv_config=config)
    with pytest.raises(InputError, match="2 keys need 32 host indices"):
        backend.batch_get_v1(sglang_keys(2), indices([0]))
    with pytest.raises(LayoutError, match="mamba pool has no tierkv layout"):
        backend.register_mem_host_pool_v2(pool, hs.PoolName.MAMBA)
    backend.register_mem_host_pool_v2(pool, hs.PoolName.KV)


def test_pages_survive_a_restart(tmp_path: Path, backends: Backends) -> None:
    """Eight pages through a four-page DRAM tier: a restart finds all of them, byte for byte."""
    pool = HostPool(False, "page_first", MHA)
    config = str(write_config(tmp_path, MHA))
    backend = backends(pool, tierkv_config=config)
    keys = sglang_keys(8, seed=100)
    sent = [pool.fill(p, seed=20 + p) for p in range(8)]
    assert backend.batch_set_v1(keys, indices(list(range(8)))) == [True] * 8
    backend.close()
    pool.kv_buffer.zero_()
    again = backends(pool, tierkv_config=config)
    assert again.batch_exists(keys) == 8
    assert again.batch_get_v1(keys, indices(list(range(8)))) == [True] * 8
    assert all(torch.equal(pool.page(p), sent[p]) for p in range(8))
    assert again.store.stats().tiers["nvme"].hits >= 4


def test_clear_hides_every_page_and_survives_a_restart(tmp_path: Path, backends: Backends) -> None:
    pool = HostPool(False, "page_first", MHA)
    config = str(write_config(tmp_path, MHA))
    backend = backends(pool, tierkv_config=config)
    old, new = sglang_keys(3, seed=1), sglang_keys(2, seed=50)
    for p in range(3):
        pool.fill(p, seed=p)
    assert backend.batch_set_v1(old, indices([0, 1, 2])) == [True] * 3
    backend.clear()
    assert backend.batch_exists(old) == 0 and backend.batch_get_v1(old, indices([3, 4, 5])) == [False] * 3
    assert backend.batch_set_v1(new, indices([0, 1])) == [True, True]
    backend.close()
    again = backends(pool, tierkv_config=config)
    assert again.batch_exists(old) == 0 and again.batch_exists(new) == 2


def test_through_a_daemon_tenants_and_ranks_see_only_their_pages(tmp_path: Path, sock_dir: Path,
                                                                 backends: Backends) -> None:
    """Several engines' ranks on one ``tierkv serve`` store: a page is found only by the same
    model, tenant and TP rank (MLA: by every rank, written by rank 0 only); ``clear()`` on
    one rank is seen by the others; a daemon gone makes misses and failed writes, not errors."""
    service = NodeService(load_config(write_config(tmp_path, MHA)), sock_dir / "t.sock").start()
    try:
        sock = str(service.path)
        pool = HostPool(False, "page_first", MHA)
        keys = sglang_keys(2)
        sent = [pool.fill(p, seed=30 + p) for p in range(2)]
        rank0 = backends(pool, tp=(0, 2), tierkv_socket=sock)
        assert rank0.batch_set_v1(keys, indices([0, 1])) == [True, True]
        same = backends(HostPool(False, "page_first", MHA), tp=(0, 2), tierkv_socket=sock)
        assert same.batch_get_v1(keys, indices([2, 3])) == [True, True]
        assert all(torch.equal(same.mem_pool_host.page(2 + p), sent[p]) for p in range(2))
        others = [backends(pool, tp=(1, 2), tierkv_socket=sock),
                  backends(pool, tp=(0, 2), tierkv_socket=sock, tierkv_tenant="acme"),
                  backends(pool, tp=(0, 2), model="org/other-model", tierkv_socket=sock),
                  backends(HostPool(False, "layer_first", MHA), tp=(0, 2), tierkv_socket=sock)]
        assert [o.batch_exists(keys) for o in others] == [0, 0, 0, 0]
        same.clear()
        assert rank0.batch_exists(keys) == 0
        assert rank0.store.stats().pages_stored == 2    # cleared pages stay stored until evicted
    finally:
        service.close()
    assert rank0.batch_exists(keys) == 0 and rank0.batch_set_v1(keys, indices([0, 1])) == [False, False]
    assert rank0.batch_get_v1(keys, indices([0, 1])) == [False, False] and rank0.get(keys[0]) is None


def test_mla_pages_are_shared_by_ranks_and_written_by_one(tmp_path: Path, sock_dir: Path,
                                                          backends: Backends) -> None:
    service = NodeService(load_config(write_config(tmp_path, MLA)), sock_dir / "m.sock").start()
    try:
        sock = str(service.path)
        keys = sglang_keys(2, seed=9)
        reader = backends(HostPool(True, "page_first", MLA), True, tp=(1, 2), tierkv_socket=sock)
        reader.mem_pool_host.fill(0, seed=1)
        assert reader.batch_set_v1(keys, indices([0, 1])) == [True, True]   # not the writer: nothing written
        assert reader.batch_exists(keys) == 0
        writer = backends(HostPool(True, "page_first", MLA), True, tp=(0, 2), tierkv_socket=sock)
        sent = writer.mem_pool_host.fill(3, seed=2)
        assert writer.batch_set_v1(keys[:1], indices([3])) == [True]
        assert reader.batch_get_v1(keys, indices([5, 6])) == [True, False]
        assert torch.equal(reader.mem_pool_host.page(5), sent)
    finally:
        for b in backends.made:
            b.close()
        service.close()
