"""The engine adapter over a real store: specs, pins, copies by block id, events, failures.

A small layout keeps pages at 1 KiB; the engine's KV is a vLLM-shaped paged cache per
layer (:class:`PagedKV`), on CPU, and on CUDA too where a GPU is present.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from tierkv.store.api import Store
from tierkv.config import DramConfig, NvmeConfig, StoreConfig
from tierkv.errors import InputError, LayoutError
from tierkv.integrations.adapter import EventKind, OffloadScheduler, external_key_tokens
from tierkv.integrations.worker import OffloadWorker, PagedKV
from tierkv.keys import PageKey
from tierkv.layout import KVLayout, PageOrder

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="fp32", tokens_per_page=4)
T = LAYOUT.tokens_per_page
NUM_BLOCKS = 8

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu,
                                            pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]),
]


def open_store(path: Path, dram_pages: int, nvme_pages: int = 0) -> Store:
    return Store.open(StoreConfig(path=str(path), model_id="adapter-test", layout=LAYOUT,
                                  dram=DramConfig(dram_pages * LAYOUT.page_bytes) if dram_pages else None,
                                  nvme=NvmeConfig(nvme_pages * 4096) if nvme_pages else None))


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = open_store(tmp_path / "store", dram_pages=2, nvme_pages=32)
    yield s
    s.close()


@pytest.fixture
def small_store(tmp_path: Path) -> Iterator[Store]:
    """Four DRAM pages and nothing below: evicted pages leave the store."""
    s = open_store(tmp_path / "small", dram_pages=4)
    yield s
    s.close()


def engine_kv(device: str, seed: int | None) -> PagedKV:
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    shape = (2, NUM_BLOCKS, T, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    layers = [torch.randn(shape, generator=g) if g is not None else torch.zeros(shape) for _ in range(LAYOUT.num_layers)]
    return PagedKV([t.to(device) for t in layers])


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def store_via_adapter(sched: OffloadScheduler, worker: OffloadWorker, toks: list[int], blocks: list[int]) -> None:
    spec = sched.prepare_store(toks, blocks)
    assert spec is not None
    result = worker.transfer(spec)
    sched.complete_store(spec, result.success)
    assert result.success, result.error


@pytest.mark.parametrize("device", DEVICES)
def test_store_then_load_by_block_id_is_exact(store: Store, device: str) -> None:
    src, dst = engine_kv(device, seed=1), engine_kv(device, seed=None)
    src_before = [t.clone() for t in src.layers]
    sched = OffloadScheduler(store)
    prompt = tokens(100, 3 * T + 2)
    store_via_adapter(sched, OffloadWorker(store, src), prompt, [5, 2, 7])
    spec = sched.prepare_load(prompt, [1, 3, 0])
    assert spec is not None and spec.block_ids == (1, 3, 0)
    result = OffloadWorker(store, dst).transfer(spec)
    sched.complete_load(spec)
    assert result.success and result.pages == 3 and result.failed_block_ids == ()
    assert sum(result.tokens_per_tier.values()) == 3 * T
    assert set(result.tokens_per_tier) <= {"dram", "nvme"} and result.tokens_per_tier.get("nvme", 0) > 0
    for s, d, before in zip(src.layers, dst.layers, src_before):
        assert torch.equal(s, before), "the source blocks changed"
        for src_block, dst_block in ((5, 1), (2, 3), (7, 0)):
            assert torch.equal(d[:, dst_block], s[:, src_block])
        untouched = [b for b in range(NUM_BLOCKS) if b not in (1, 3, 0)]
        assert torch.count_nonzero(d[:, untouched]) == 0, "blocks outside the spec were written"
    assert sched.pending() == (0, 0)


def test_lookup_leaves_the_last_token_to_compute(store: Store) -> None:
    sched = OffloadScheduler(store)
    prompt = tokens(0, 3 * T)
    store_via_adapter(sched, OffloadWorker(store, engine_kv("cpu", 2)), prompt, [0, 1, 2])
    assert store.lookup(prompt).cached_pages == 3
    assert sched.lookup(prompt).cached_pages == 2
    assert sched.lookup(prompt + [7]).cached_tokens == 3 * T
    assert sched.prepare_store(prompt, [0, 1, 2]) is None, "every page is stored already"


def test_prepare_store_pins_present_pages_until_complete(small_store: Store) -> None:
    sched = OffloadScheduler(small_store)
    worker = OffloadWorker(small_store, engine_kv("cpu", 3))
    p = tokens(0, 4 * T)
    store_via_adapter(sched, worker, p[: 2 * T], [0, 1])
    spec = sched.prepare_store(p, [0, 1, 2, 3])
    assert spec is not None and spec.first_page == 2 and spec.block_ids == (2, 3)
    for other in (1000, 2000):  # two more 2-page prompts: pressure on a 4-page store
        small_store.put(tokens(other, 2 * T), torch.zeros(2, *LAYOUT.page_shape))
    assert small_store.lookup(p).cached_pages == 2, "pinned pages were evicted"
    result = worker.transfer(spec)
    sched.complete_store(spec, result.success)
    assert result.success and result.pages == 2
    assert small_store.lookup(p).cached_pages == 4
    small_store.put(tokens(3000, 4 * T), torch.zeros(4, *LAYOUT.page_shape))
    assert small_store.lookup(p).cached_pages == 0, "complete_store left pages pinned"


def test_prepare_load_pins_until_complete(small_store: Store) -> None:
    sched = OffloadScheduler(small_store)
    p = tokens(0, 2 * T + 1)
    store_via_adapter(sched, OffloadWorker(small_store, engine_kv("cpu", 4)), p, [0, 1])
    spec = sched.prepare_load(p, [4, 5])
    assert spec is not None and spec.num_pages == 2
    small_store.put(tokens(500, 4 * T), torch.zeros(4, *LAYOUT.page_shape))
    assert small_store.lookup(p).cached_pages == 2
    sched.complete_load(spec)
    with pytest.raises(InputError, match="not pending"):
        sched.complete_load(spec)
    small_store.put(tokens(900, 4 * T), torch.zeros(4, *LAYOUT.page_shape))
    assert small_store.lookup(p).cached_pages == 0


def test_events_report_stored_then_removed_pages(small_store: Store) -> None:
    sched = OffloadScheduler(small_store)
    worker = OffloadWorker(small_store, engine_kv("cpu", 5))
    p = tokens(0, 3 * T)
    store_via_adapter(sched, worker, p[: 2 * T], [0, 1])
    store_via_adapter(sched, worker, p, [0, 1, 2])
    keys = sched.page_keys(p)
    assert keys == [small_store._keys(p, "")[i * 16:(i + 1) * 16] for i in range(3)]
    events = sched.take_events()
    assert [(e.kind, e.first_page, e.keys) for e in events] == [
        (EventKind.STORED, 0, tuple(keys[:2])), (EventKind.STORED, 2, (keys[2],))]
    assert sched.take_events() == []
    small_store.put(tokens(700, 4 * T), torch.zeros(4, *LAYOUT.page_shape))  # evicts all of p
    events = sched.take_events()
    assert [(e.kind, e.first_page, e.keys) for e in events] == [(EventKind.REMOVED, 0, tuple(keys))]
    assert sched.take_events() == []


def test_tenants_do_not_share_pages(store: Store) -> None:
    sched = OffloadScheduler(store)
    p = tokens(0, 2 * T + 1)
    spec = sched.prepare_store(p, [0, 1], tenant="acme")
    assert spec is not None
    sched.complete_store(spec, OffloadWorker(store, engine_kv("cpu", 6)).transfer(spec).success)
    assert sched.lookup(p, tenant="acme").cached_pages == 2
    assert sched.lookup(p, tenant="other").cached_pages == 0
    assert sched.prepare_load(p, [0, 1], tenant="other") is None


def test_failures_are_results_not_crashes(tmp_path: Path) -> None:
    s = open_store(tmp_path / "s", dram_pages=4)
    sched = OffloadScheduler(s)
    p = tokens(0, 2 * T + 1)
    store_via_adapter(sched, OffloadWorker(s, engine_kv("cpu", 7)), p, [0, 1])
    spec = sched.prepare_load(p, [0, NUM_BLOCKS + 3])  # a block id the engine does not have
    assert spec is not None
    bad = OffloadWorker(s, engine_kv("cpu", None)).transfer(spec)
    sched.complete_load(spec)
    assert not bad.success and bad.failed_block_ids == (0, NUM_BLOCKS + 3) and "block ids" in (bad.error or "")
    spec = sched.prepare_load(p, [0, 1])
    assert spec is not None
    s.close()
    closed = OffloadWorker(s, engine_kv("cpu", None)).transfer(spec)
    assert not closed.success and "StoreClosedError" in (closed.error or "")


def test_rolled_back_store_announces_nothing(store: Store) -> None:
    sched = OffloadScheduler(store)
    spec = sched.prepare_store(tokens(0, 2 * T), [0, 1])
    assert spec is not None
    sched.complete_store(spec, success=False)
    assert sched.take_events() == [] and store.lookup(tokens(0, 2 * T)).cached_pages == 0
    assert sched.pending() == (0, 0)


def test_submitted_transfers_finish_once(store: Store) -> None:
    sched = OffloadScheduler(store)
    spec = sched.prepare_store(tokens(0, 2 * T), [3, 4])
    assert spec is not None
    with OffloadWorker(store, engine_kv("cpu", 8)) as worker:
        result = worker.submit(spec).result(timeout=30)
        assert result.success and result.job_id == spec.job_id
        assert worker.get_finished() == [result]
        assert worker.get_finished() == []
    sched.complete_store(spec, result.success)
    assert store.lookup(tokens(0, 2 * T)).cached_pages == 2


class HiCacheShim:
    """SGLang's HiCacheStorage batch calls over the adapter, as docs/integration.md describes.

    SGLang names pages by its own chained digests and addresses its host pool by page;
    each key becomes a one-page prompt of :func:`external_key_tokens`.
    """

    def __init__(self, store: Store, host_pool: PagedKV) -> None:
        self.sched = OffloadScheduler(store)
        self.worker = OffloadWorker(store, host_pool)

    def _tokens(self, key: str) -> list[int]:
        return [int(t) for t in external_key_tokens(key, T)]

    def batch_exists(self, keys: list[str]) -> int:
        for i, key in enumerate(keys):
            if self.sched.lookup(self._tokens(key), leave_last_token=False).cached_pages == 0:
                return i
        return len(keys)

    def batch_get_v1(self, keys: list[str], host_pages: list[int]) -> list[bool]:
        out = []
        for key, page in zip(keys, host_pages):
            spec = self.sched.prepare_load(self._tokens(key), [page], leave_last_token=False)
            ok = False
            if spec is not None:
                ok = self.worker.transfer(spec).success
                self.sched.complete_load(spec)
            out.append(ok)
        return out

    def batch_set_v1(self, keys: list[str], host_pages: list[int]) -> list[bool]:
        out = []
        for key, page in zip(keys, host_pages):
            spec = self.sched.prepare_store(self._tokens(key), [page])
            if spec is None:  # already stored
                out.append(True)
                continue
            result = self.worker.transfer(spec)
            self.sched.complete_store(spec, result.success)
            out.append(result.success)
        return out


def test_an_sglang_shaped_shim_round_trips_pages_by_key(store: Store) -> None:
    src, dst = engine_kv("cpu", 9), engine_kv("cpu", None)
    keys = [f"{i:064x}" for i in (11, 22, 33)]
    assert HiCacheShim(store, src).batch_set_v1(keys, [4, 0, 6]) == [True, True, True]
    shim = HiCacheShim(store, dst)
    assert shim.batch_exists(keys) == 3
    assert shim.batch_exists([keys[0], keys[1], "f" * 64, keys[2]]) == 2
    assert shim.batch_get_v1(keys, [1, 2, 3]) == [True, True, True]
    for s, d in zip(src.layers, dst.layers):
        for src_block, dst_block in ((4, 1), (0, 2), (6, 3)):
            assert torch.equal(d[:, dst_block], s[:, src_block])
    assert shim.batch_get_v1(["0" * 64], [5]) == [False]
    with pytest.raises(InputError, match="at least 4 tokens"):
        external_key_tokens("k", 2)


def _spy_requests(store: Store, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The page counts of the requests the store shows its eviction policy."""
    announced: list[int] = []
    note = store._manager.note_request

    def spy(keys: Sequence[PageKey]) -> None:
        announced.append(len(keys))
        note(keys)

    monkeypatch.setattr(store._manager, "note_request", spy)
    return announced


def test_store_stats_count_each_requests_misses_and_only_engine_lookups(store: Store,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the adapter the worker asks the store only for pages a lookup found, yet
    stats() must count the request's misses; bookkeeping lookups are not the engine's,
    and the policy sees each request once (load and store of one prompt)."""
    announced = _spy_requests(store, monkeypatch)
    sched = OffloadScheduler(store)
    worker = OffloadWorker(store, engine_kv("cpu", 5))
    first = tokens(0, 3 * T + 1)
    assert sched.lookup(first).cached_pages == 0
    assert sched.prepare_load(first, [], request_id="r1") is None    # nothing to load: counted all the same
    spec_s = sched.prepare_store(first, [0, 1, 2], request_id="r1")
    assert spec_s is not None and spec_s.announced
    worker.submit(spec_s).result(timeout=30)                          # on the worker's thread
    sched.complete_store(spec_s)
    second = first[:3 * T] + tokens(500, 2 * T + 1)          # the next turn: 3 pages cached, 2 new
    assert sched.lookup(second).cached_pages == 3
    spec = sched.prepare_load(second, [4, 5, 6], request_id="r2")
    assert spec is not None and worker.transfer(spec).pages == 3
    sched.complete_load(spec)
    spec_s = sched.prepare_store(second + tokens(900, T), [4, 5, 6, 0, 1, 2], request_id="r2")   # grown by its reply
    assert spec_s is not None
    worker.submit(spec_s).result(timeout=30)
    sched.complete_store(spec_s)
    worker.close()
    sched.take_events()
    st = store.stats()
    assert st.lookups == 2, "the adapter's own lookups were counted as the engine's"
    assert (st.pages_requested, st.pages_hit, st.misses) == (3 + 5, 3, 5)
    assert sum(t.hits for t in st.tiers.values()) == st.pages_hit
    assert announced == [3, 5], "each request must reach the policy once, with its whole prompt"


def test_every_request_reaches_the_policy(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A get that needs no put (a full hit) must not swallow the next request's put."""
    announced = _spy_requests(store, monkeypatch)
    a, b = tokens(0, 2 * T), tokens(0, 4 * T)
    store.put(a, torch.zeros(2, *LAYOUT.page_shape))
    store.get(a, torch.zeros(2, *LAYOUT.page_shape))           # a full hit: no put follows
    store.put(b, torch.zeros(4, *LAYOUT.page_shape))           # the next request, put only
    assert announced == [2, 2, 4]


@pytest.mark.parametrize("stored_again", [False, True])
def test_a_page_gone_under_a_load_leaves_no_pins(tmp_path: Path, stored_again: bool) -> None:
    """Page 0 fails its checksum during the load and is dropped: unpinning must still
    reach pages 1.., which no prefix walk finds any more. ``stored_again``: another
    request recomputes and stores page 0 before the load completes, and that new page 0
    (nobody's pin) must not end the unpin short of pages 1.. either."""
    s = open_store(tmp_path / "s", dram_pages=0, nvme_pages=64)
    try:
        sched = OffloadScheduler(s)
        worker = OffloadWorker(s, engine_kv("cpu", 6))
        prompt = tokens(100, 4 * T + 1)
        store_via_adapter(sched, worker, prompt, [0, 1, 2, 3])
        keys = sched.page_keys(prompt)
        nvme = s._manager.tiers[0]
        slot = s._manager.entry(keys[0]).slots[nvme.name]          # type: ignore[union-attr]
        with open(nvme.path, "r+b") as f:                          # type: ignore[attr-defined]
            f.seek(nvme.header_bytes + slot * nvme.slot_bytes)     # type: ignore[attr-defined]
            f.write(b"\xff" * 64)
        spec = sched.prepare_load(prompt, [4, 5, 6, 7], request_id="A")
        assert spec is not None and spec.num_pages == 4
        assert worker.transfer(spec).pages == 0
        if stored_again:
            spec_b = sched.prepare_store(prompt, [0, 1, 2, 3], request_id="B")
            assert spec_b is not None
            sched.complete_store(spec_b, worker.transfer(spec_b).success)
        sched.complete_load(spec)
        left = [e.pins for e in map(s._manager.entry, keys) if e is not None]
        assert left == [0] * (4 if stored_again else 3), f"pages stayed pinned: {left}"
    finally:
        s.close()


def test_a_pinned_page_gone_before_its_store_is_never_stored_from_an_unfilled_row(tmp_path: Path) -> None:
    """prepare_store pins the pages already stored and the worker leaves their rows
    unfilled. If one fails its checksum under another request meanwhile, the pending
    store must not write that unfilled row as the page."""
    s = open_store(tmp_path / "s", dram_pages=0, nvme_pages=64)
    try:
        kv = engine_kv("cpu", 7)
        sched, worker = OffloadScheduler(s), OffloadWorker(s, kv)
        prompt = tokens(100, 6 * T)
        store_via_adapter(sched, worker, prompt[:4 * T], [0, 1, 2, 3])
        spec = sched.prepare_store(prompt, [0, 1, 2, 3, 4, 5])
        assert spec is not None and spec.first_page == 4
        nvme = s._manager.tiers[0]
        slot = s._manager.entry(sched.page_keys(prompt)[2]).slots[nvme.name]   # type: ignore[union-attr]
        with open(nvme.path, "r+b") as f:                                       # type: ignore[attr-defined]
            f.seek(nvme.header_bytes + slot * nvme.slot_bytes)                  # type: ignore[attr-defined]
            f.write(b"\xff" * 64)                                               # page 2 rots on disk
        assert s.get(prompt[:4 * T], torch.zeros(4, *LAYOUT.page_shape)).pages == 2
        result = worker.transfer(spec)
        sched.complete_store(spec, result.success)
        truth = torch.empty(6, *LAYOUT.page_shape)
        kv.gather([0, 1, 2, 3, 4, 5], truth)
        out = torch.zeros(6, *LAYOUT.page_shape)
        n = s.get(prompt, out).pages
        assert n == 2 and torch.equal(out[:n], truth[:n]), f"{n} pages served"
    finally:
        s.close()


def test_a_one_page_prompt_reaches_the_policy_once(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt of exactly one page has nothing an engine may load (its last token is
    computed), yet its store must still reach the policy, once."""
    announced = _spy_requests(store, monkeypatch)
    sched = OffloadScheduler(store)
    prompt = tokens(0, T)
    assert sched.prepare_load(prompt, [], request_id="r") is None
    spec = sched.prepare_store(prompt, [0], request_id="r")
    assert spec is not None
    sched.complete_store(spec, OffloadWorker(store, engine_kv("cpu", 8)).transfer(spec).success)
    assert announced == [1]
    assert store.stats().pages_requested == 0          # nothing it could have loaded


def test_a_store_in_another_page_order_is_refused(tmp_path: Path) -> None:
    from dataclasses import replace

    other = replace(LAYOUT, page_order=PageOrder.VLLM_CPU)
    with Store.open(StoreConfig(path=str(tmp_path / "v"), model_id="m", layout=other,
                                dram=DramConfig(4 * other.page_bytes))) as s:
        with pytest.raises(LayoutError, match="page_order 'vllm_cpu'; OffloadWorker reads and writes the 'standard'"):
            OffloadWorker(s, engine_kv("cpu", 0))


def test_a_closed_worker_refuses_submits_and_starts_no_thread(store: Store) -> None:
    import threading

    from tierkv.errors import StoreClosedError
    sched = OffloadScheduler(store)
    worker = OffloadWorker(store, engine_kv("cpu", 1))
    first = sched.prepare_store(tokens(0, 2 * T), [0, 1])
    assert first is not None and worker.submit(first).result(timeout=30).success
    worker.close()
    spec = sched.prepare_store(tokens(100, 2 * T), [2, 3])
    assert spec is not None
    with pytest.raises(StoreClosedError, match="OffloadWorker is closed"):
        worker.submit(spec)
    assert not [t for t in threading.enumerate() if t.name.startswith("tierkv-worker")]
    assert worker.transfer(spec).success                # inline transfers still run
    sched.complete_store(spec)
