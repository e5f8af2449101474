"""The vLLM connector's halves without vLLM: the planner and the worker,
against a real ``tierkv serve`` daemon (a NodeService thread) and CPU tensors shaped as
vLLM's CPU backend shapes its KV cache. The real engine: test_vllm_engine.py."""

from __future__ import annotations

import dataclasses
import itertools
import os
import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tierkv.config import DramConfig, NvmeConfig, StoreConfig
from tierkv.tiers.base import TierKind
from tierkv.errors import AccessDeniedError, InputError, TierKVError
from tierkv.integrations.vllm.blocks import CpuPagedKV
from tierkv.integrations.vllm import early
from tierkv.integrations.vllm.early import EarlyListener, EarlySender, channel_address, encode
from tierkv.integrations.vllm.plan import ConnectorPlanner, LoadJob, StepPlan
from tierkv.integrations.vllm.transfer import ConnectorWorker
from tierkv.layout import KVLayout
from tierkv.serve.client import RemoteStore
from tierkv.serve.daemon import NodeService
from tests.integrations.test_vllm_blocks import DA, LAYOUT, NA, D, H, L, N, amx_element, engine_caches
from tests.polling import wait_for


@pytest.fixture(params=["standard", "vllm_cpu"])
def daemon(request: pytest.FixtureRequest, sock_dir: Path, tmp_path: Path) -> Iterator[NodeService]:
    """A daemon whose pages are in either page order (the worker copies whole blocks in the
    engine's own order, or permutes to and from the standard one)."""
    layout = KVLayout(L, H, D, "bf16", N, page_order=request.param)
    cfg = StoreConfig(path=str(tmp_path / "store"), model_id="m", layout=layout,
                      dram=DramConfig(8 * LAYOUT.page_bytes), nvme=NvmeConfig(64 * LAYOUT.page_bytes))
    svc = NodeService(cfg, sock_dir / "d.sock").start()
    yield svc
    svc.close()


@pytest.fixture(params=["lend", "get"])
def store(request: pytest.FixtureRequest, daemon: NodeService) -> Iterator[RemoteStore]:
    """A client; "get": one whose daemon does not lend its DRAM (as for a user limited to
    some tenants), so that workers load every page through gets."""
    with RemoteStore(daemon.path, timeout_s=10) as s:
        if request.param == "get":
            def no_pool() -> np.ndarray:
                raise AccessDeniedError("lending needs a connection whose user may use every tenant")
            s.dram_pool = no_pool  # type: ignore[method-assign]
        yield s


# -- the planner ---------------------------------------------------------------------------
def prompt(pages: float, seed: int = 0) -> list[int]:
    return list(np.random.default_rng(seed).integers(0, 50_000, int(pages * N)))


def put_pages(store: RemoteStore, tokens: list[int], tenant: str = "") -> None:
    n = len(tokens) // N
    store.put(np.array(tokens[: n * N], np.uint32), np.full((n, LAYOUT.page_bytes), 7, np.uint8), tenant)


def test_matched_leaves_the_last_token_and_skips_the_engines_own_hit(store: RemoteStore) -> None:
    p = ConnectorPlanner(store, N)
    toks = prompt(4)                       # exactly 4 pages: the last token must be computed
    put_pages(store, toks)
    assert p.matched("q", toks, "", 0) == 3 * N
    assert p.matched("q", toks + [1], "", 0) == 4 * N
    assert p.matched("q", toks + [1], "", 2 * N) == 2 * N      # vLLM's prefix cache had 2 pages
    assert p.matched("q", toks + [1], "", 4 * N) == 0
    assert p.matched("q", toks + [1], "other-tenant", 0) == 0   # the salt is the tenant
    assert p.matched("q", toks[:N], "", 0) == 0
    assert ConnectorPlanner(store, N, load=False).matched("q", toks + [1], "", 0) == 0
    assert store.stats().lookups == 0                     # engine bookkeeping is not counted as lookups


def test_allocated_pins_and_plans_the_load_then_finished_unpins(store: RemoteStore) -> None:
    p = ConnectorPlanner(store, N)
    toks = prompt(5.5)
    put_pages(store, toks)
    assert p.matched("r1", toks, "", N) == 4 * N              # vLLM's own prefix cache holds page 0
    p.allocated("r1", toks, len(toks), "", [4, 8, 1, 2, 3, 9], 4 * N)   # so pages 1-4 come from the store
    plan = p.plan([("r1", [4, 8, 1, 2, 3, 9], 5 * N)], [], {"r1": len(toks) - 5 * N})
    (job,) = plan.loads
    assert (job.skip, job.block_ids, job.end, job.requested) == (1, (8, 1, 2, 3), 5, 5)
    assert list(job.tokens) == toks[: 5 * N]
    assert plan.saves == []                               # the prompt's full pages are all stored
    assert store.unpin(np.array(toks[: 5 * N], np.uint32)) == 5   # pinned by allocated ...
    assert store.pin(np.array(toks[: 5 * N], np.uint32)) == 5     # ... (given back for finished())
    p.finished("r1")
    assert store.unpin(np.array(toks[: 5 * N], np.uint32)) == 0   # finished() unpinned
    assert p.pending() == 0
    assert p.plan([], [], {}).loads == []                 # a plan is handed out once


def test_saves_follow_the_computed_pages_prompt_then_generated(store: RemoteStore) -> None:
    for generated in (True, False):
        p = ConnectorPlanner(store, N, save_generated=generated)
        toks = prompt(2.5, seed=3 + generated)
        live = list(toks)                                  # vLLM's request list, growing
        p.allocated("r", live, len(toks), "t", [5, 6, 7], 0)
        s1 = p.plan([("r", [5, 6, 7], 0)], [], {"r": N})   # a chunk of one page
        assert [(s.first, s.block_ids, len(s.tokens)) for s in s1.saves] == [(0, (5,), N)]
        s2 = p.plan([], [("r", None, False, N)], {"r": len(toks) - N})
        assert [(s.first, s.block_ids) for s in s2.saves] == [(1, (5, 6))]   # every block up to the end
        live += prompt(1, seed=9)[: 3 * N - len(toks)]       # decode steps fill the third page
        s3 = p.plan([], [("r", [9, 10, 11], True, 0)], {"r": 3 * N})   # preempted: resumed in new blocks
        want = [(2, (9, 10, 11))] if generated else []
        assert [(s.first, s.block_ids) for s in s3.saves] == want
        if generated:
            assert list(s3.saves[0].tokens) == live[: 3 * N] and s3.saves[0].tenant == "t"
        p.finished("r")


def test_a_request_with_nothing_to_load_counts_its_misses(store: RemoteStore) -> None:
    p = ConnectorPlanner(store, N)
    toks = prompt(3.5, seed=5)
    before = store.stats()
    p.allocated("r", toks, len(toks), "", [1, 2, 3, 4], 0)
    after = store.stats()
    assert after.pages_requested - before.pages_requested == 3
    assert after.pages_hit == before.pages_hit


def test_a_store_that_is_gone_offers_nothing_and_raises_nothing(daemon: NodeService) -> None:
    store = RemoteStore(daemon.path, timeout_s=2)
    p = ConnectorPlanner(store, N)
    toks = prompt(3.5, seed=6)
    put_pages(store, toks)
    assert p.matched("q", toks, "", 0) == 3 * N
    daemon.close()
    assert p.matched("q", toks, "", 0) == 0
    p.allocated("r", toks, len(toks), "", [1, 2, 3, 4], 3 * N)   # pin fails: the load still goes to the worker
    assert len(p.plan([], [], {}).loads) == 1
    p.finished("r")
    store.close()


# -- the worker ----------------------------------------------------------------------------
def step(worker: ConnectorWorker, plan: StepPlan, write: list[torch.Tensor] | None = None,
         caches: list[torch.Tensor] | None = None) -> None:
    """What vLLM does in one step: bind, load before the forward, per layer wait/save, end."""
    worker.begin_step(plan)
    worker.start_load()
    for layer in range(L):
        worker.wait_layer(layer)
        if write is not None and caches is not None:   # the forward pass writes this layer
            caches[layer].copy_(write[layer])
        worker.save_layer(layer)
    worker.end_step()


def test_pages_saved_from_one_engine_load_into_another_bit_for_bit(store: RemoteStore) -> None:
    toks = prompt(4.5, seed=11)
    src = engine_caches(3)
    a = ConnectorWorker(store, CpuPagedKV(engine_caches(4), store.layout, "vec"), max_pages=8)
    pa = ConnectorPlanner(store, N)
    pa.allocated("a", toks, len(toks), "", [3, 1, 4, 0, 9], 0)
    step(a, pa.plan([("a", [3, 1, 4, 0, 9], 0)], [], {"a": len(toks)}), write=src, caches=a.kv.layers)
    a.drain()
    assert a.counters.saved_pages == 4 and a.counters.failed_saves == 0
    b_caches = engine_caches(5)
    b = ConnectorWorker(store, CpuPagedKV(b_caches, store.layout, "vec"), max_pages=8)
    pb = ConnectorPlanner(store, N)
    assert pb.matched("b", toks, "", 0) == 4 * N
    pb.allocated("b", toks, len(toks), "", [6, 7, 8, 10, 11], 4 * N)
    plan = pb.plan([("b", [6, 7, 8, 10, 11], 4 * N)], [], {"b": len(toks) - 4 * N})
    assert [job.lend for job in plan.loads] == [True]        # all in DRAM at the lookup: borrow them
    step(b, plan)
    for layer in range(L):
        assert torch.equal(b_caches[layer][[6, 7, 8, 10]], src[layer][[3, 1, 4, 0]])
    assert b.load_errors() == set()
    assert b.counters.loaded_tokens == 4 * N and b.counters.tokens_by_tier == {"dram": 4 * N}
    assert b.counters.lent_tokens == (4 * N if b._dram is not None else 0)   # copied straight from the pool
    a.close()
    b.close()


def serve_and_save(store: RemoteStore, tokens: list[int]) -> None:
    """An engine computes ``tokens`` (7 blocks; KV of engine_caches(7)) and saves its pages."""
    a = ConnectorWorker(store, CpuPagedKV(engine_caches(8), store.layout, "vec"), max_pages=8)
    pa = ConnectorPlanner(store, N)
    pa.allocated("a", tokens, len(tokens), "", [0, 1, 2, 3, 4, 5, 6], 0)
    step(a, pa.plan([("a", [0, 1, 2, 3, 4, 5, 6], 0)], [], {"a": len(tokens)}), write=engine_caches(7),
         caches=a.kv.layers)
    a.drain()
    a.close()


def loaded_pages(caches: list[torch.Tensor], layout: KVLayout, blocks: list[int]) -> np.ndarray:
    """What the engine blocks ``blocks`` hold, as store pages (uint8 rows)."""
    got = torch.zeros(len(blocks), layout.page_bytes, dtype=torch.uint8)
    kv = CpuPagedKV(caches, layout, "vec")
    for layer in range(L):
        kv.gather(layer, blocks, kv.pages(got))
    return got.numpy()


def test_a_spliced_prompt_loads_its_derived_pages_when_the_request_accepts_them(store: RemoteStore) -> None:
    """An agent dropped a span of a cached prompt and spliced it through the daemon; the
    request that accepts derived pages loads the exact and the moved pages as one prefix
    (got whole, never lent), the same bytes the store's own derived get returns; one that
    does not loads only the pages before the edit."""
    from tierkv.splice.rope import Rope

    old = prompt(6.5, seed=21)
    serve_and_save(store, old)
    res = store.splice(np.array(old, np.uint32), 20, 45, np.zeros(0, np.uint32), rope=Rope.from_theta(10000.0, D))
    new = [int(t) for t in res.tokens]                    # 6.5 * 16 - 25 = 79 tokens: 4 whole pages and a part
    assert res.first_derived == 1 and res.derived == 3 and res.stored == 3
    pb = ConnectorPlanner(store, N)
    assert pb.matched("x", new, "", 0) == N               # exact only: the page before the edit
    assert pb.matched("b", new, "", 0, accept="derived") == 4 * N
    pb.allocated("b", new, len(new), "", [9, 8, 7, 6, 5], 4 * N)
    plan = pb.plan([("b", [9, 8, 7, 6, 5], 4 * N)], [], {"b": len(new) - 4 * N})
    (job,) = plan.loads
    assert job.accept == "derived" and not job.lend and early.decode(encode(job)[4:])[0].accept == "derived"
    b_caches = engine_caches(9)
    b = ConnectorWorker(store, CpuPagedKV(b_caches, store.layout, "vec"), max_pages=8)
    step(b, plan)
    assert b.load_errors() == set() and b.counters.loaded_tokens == 4 * N
    want = np.zeros((4, store.layout.page_bytes), np.uint8)
    assert store.get(np.array(new[:4 * N], np.uint32), want, accept="derived").derived == 3
    assert np.array_equal(loaded_pages(b_caches, store.layout, [9, 8, 7, 6]), want)
    # What the request computes after derived pages attended to an approximation: never saved.
    later = pb.plan([], [("b", None, False, 4 * N)], {"b": len(new) - 4 * N + 40})
    assert later.saves == []
    pb.finished("b")
    assert pb._accept == {} and pb.pending() == 0
    b.close()


@pytest.mark.parametrize("salt, params, prefix_caching, want", [
    ("t", None, True, ("exact", "t")),                                         # an ordinary request
    ("t", {"tierkv_accept": "exact"}, False, ("exact", "t")),
    ("t", {"tierkv_accept": "derived"}, False, ("derived", "t")),              # no vLLM cache to leak into
    ("own", {"tierkv_accept": "derived", "tierkv_tenant": "t"}, False, ("derived", "t")),
    ("own", {"tierkv_accept": "derived", "tierkv_tenant": "t"}, True, ("derived", "t")),
    ("t", {"tierkv_accept": "derived"}, True, None),                           # its blocks would serve exact requests
    ("t", {"tierkv_accept": "derived", "tierkv_tenant": "t"}, True, None),     # a salt that is not its own
    ("", {"tierkv_accept": "derived", "tierkv_tenant": ""}, True, None),
    ("own", {"tierkv_accept": "derived", "tierkv_tenant": 7}, True, None),     # a tenant that is not a name
    ("t", ["tierkv_accept", "derived"], True, ("exact", "t")),                 # not a dict: nothing asked
    ("t", {"tierkv_edit": {"start": 1}}, False, ("derived", "t")),             # an edit implies derived pages
    ("t", {"tierkv_edit": {"start": 1}, "tierkv_accept": "exact"}, False, ("exact", "t")),   # unless told otherwise
    ("t", {"tierkv_edit": {"start": 1}}, True, None),                          # the same prefix-cache rule
    ("t", {"tierkv_accept": "lossy", "tierkv_lossy_bits": 4}, False, ("lossy:4.0", "t")),
    ("own", {"tierkv_accept": "lossy", "tierkv_lossy_bits": 2.5, "tierkv_tenant": "t"}, True, ("lossy:2.5", "t")),
    ("t", {"tierkv_accept": "lossy", "tierkv_lossy_bits": 4.0}, True, None),   # the same prefix-cache rule
    ("t", {"tierkv_accept": "lossy"}, False, None),                            # no budget
    ("t", {"tierkv_accept": "lossy", "tierkv_lossy_bits": "4"}, False, None),  # not a number
    ("t", {"tierkv_accept": "lossy", "tierkv_lossy_bits": 16}, False, None),   # not a lossy budget
    ("t", {"tierkv_accept": "lossy:4.0"}, False, ("exact", "t")),              # the internal spelling: nothing asked
    ("", {"tierkv_accept": "lossy", "tierkv_lossy_bits": 4, "tierkv_tenant": "t"}, True, None),   # no salt: shared
    ("", {"tierkv_accept": "derived", "tierkv_tenant": "t"}, True, None),
])
def test_a_request_gets_derived_pages_only_where_vllms_cache_cannot_pass_them_on(
        salt: str, params: object, prefix_caching: bool, want: tuple[str, str] | None) -> None:
    """With vLLM's prefix cache on, blocks a request loaded serve later requests of the same
    tokens and cache_salt: a derived request needs a salt of its own (and names its tierkv
    tenant), or it is served exact pages only (None)."""
    from tierkv.integrations.vllm.connector import request_accept

    assert request_accept(salt, params, prefix_caching) == want


def lossy_prompt(store: RemoteStore, seed: int, bits: float, **kw: Any) -> tuple[list[int], np.ndarray]:
    """A 6.5-page prompt whose first 2 pages are stored exact and all 6 lossy at ``bits``
    (``kw``: put_lossy's importance, evict); its pages as put (the layout's order)."""
    from tierkv.store.lossy_pages import from_float

    toks = prompt(6.5, seed=seed)
    x = np.random.default_rng(seed).standard_normal((6, *store.layout.page_shape)).astype(np.float32)
    rows = np.stack([from_float(page, "bf16") for page in x])
    store.put(np.array(toks[:2 * N], np.uint32), rows[:2])
    store.put_lossy(np.array(toks[:6 * N], np.uint32), rows, bits, **kw)
    return toks, rows


def test_a_request_that_accepts_lossy_pages_loads_them_after_the_exact_ones(store: RemoteStore) -> None:
    """Pages a lossy tier converted (here put lossy, keeping every token): a request that
    accepts their budget loads the exact pages and the lossy ones after them as one
    prefix (got whole, never lent), decoded as the store's own lossy get decodes them; one
    that does not loads the exact pages only; what the request computes is never saved."""
    from tierkv.integrations.vllm.plan import lossy_accept

    toks, _ = lossy_prompt(store, 31, 8.0, evict=False)
    pb = ConnectorPlanner(store, N)
    assert pb.matched("x", toks, "", 0) == 2 * N
    assert pb.matched("x", toks, "", 0, accept=lossy_accept(6.0)) == 2 * N      # another budget: not these
    assert pb.matched("c", toks, "", 0, accept=lossy_accept(8.0)) == 6 * N
    blocks = [9, 8, 7, 6, 5, 4, 3]
    pb.allocated("c", toks, len(toks), "", blocks, 6 * N)
    plan = pb.plan([("c", blocks, 6 * N)], [], {"c": len(toks) - 6 * N})
    (job,) = plan.loads
    assert job.accept == "lossy:8.0" and not job.lend and early.decode(encode(job)[4:])[0].accept == "lossy:8.0"
    caches = engine_caches(9)
    w = ConnectorWorker(store, CpuPagedKV(caches, store.layout, "vec"), max_pages=8)
    step(w, plan)
    assert w.load_errors() == set() and w.counters.loaded_tokens == 6 * N
    want = np.zeros((6, store.layout.page_bytes), np.uint8)
    assert store.get(np.array(toks[:6 * N], np.uint32), want, accept_lossy=8.0).lossy == 4
    assert np.array_equal(loaded_pages(caches, store.layout, blocks[:6]), want)
    later = pb.plan([], [("c", None, False, 6 * N)], {"c": len(toks) - 6 * N + 40})
    assert later.saves == []
    pb.finished("c")
    pb.finished("x")
    assert pb._accept == {}
    w.close()


def test_a_lossy_page_that_dropped_tokens_ends_the_load(store: RemoteStore) -> None:
    """vLLM's paged attention cannot drop a token: a lossy page whose coding evicted some
    (put_lossy with eviction, at 4 bits: below the 4.26 these pages need keeping every
    token) ends the load there, and its blocks and those after are recomputed."""
    from tierkv.integrations.vllm.plan import lossy_accept
    from tierkv.lossy.format import min_budget

    assert min_budget(L, N, H, D) > 4.0
    toks, _ = lossy_prompt(store, 32, 4.0, evict=True)
    got = store.get(np.array(toks[:6 * N], np.uint32), np.zeros((6, store.layout.page_bytes), np.uint8),
                    accept_lossy=4.0)
    assert got.lossy == 4 and got.evicted is not None and not got.evicted[:2].any() and got.evicted[2].any()
    pb = ConnectorPlanner(store, N)
    blocks = [9, 8, 7, 6, 5, 4, 3]
    assert pb.matched("c", toks, "", 0, accept=lossy_accept(4.0)) == 6 * N
    pb.allocated("c", toks, len(toks), "", blocks, 6 * N)
    w = ConnectorWorker(store, CpuPagedKV(engine_caches(9), store.layout, "vec"), max_pages=8)
    step(w, pb.plan([("c", blocks, 6 * N)], [], {"c": len(toks) - 6 * N}))
    assert w.counters.loaded_tokens == 2 * N and w.load_errors() == set(blocks[2:6])
    w.close()


def test_a_page_that_dropped_tokens_inside_vllms_own_hit_does_not_end_the_load(store: RemoteStore) -> None:
    """The get reads from page 0, but pages vLLM's own prefix cache holds are not copied:
    tokens dropped there are none of the load's business (a review found the whole load
    failed for them)."""
    from tierkv.integrations.vllm.plan import lossy_accept
    from tierkv.lossy.alloc import Importance
    from tierkv.store.lossy_pages import from_float

    toks = prompt(6.5, seed=33)
    x = np.random.default_rng(33).standard_normal((6, *store.layout.page_shape)).astype(np.float32)
    rows = np.stack([from_float(page, "bf16") for page in x])
    store.put(np.array(toks[:2 * N], np.uint32), rows[:2])
    a2 = np.full((L, H, 3 * N), 1e3)
    a2[:, :, 2 * N:2 * N + 4] = 1e-9                         # a few of page 2's tokens: worthless
    store.put_lossy(np.array(toks[:3 * N], np.uint32), rows[:3], 4.5, importance=Importance(a2, np.ones((L, H, D))))
    store.put_lossy(np.array(toks[:6 * N], np.uint32), rows, 4.5, evict=False)   # pages 3..5 keep every token
    got = store.get(np.array(toks[:6 * N], np.uint32), np.zeros((6, store.layout.page_bytes), np.uint8),
                    accept_lossy=4.5)
    assert got.evicted is not None and got.evicted[2].any() and not got.evicted[3:].any()
    pb = ConnectorPlanner(store, N)
    blocks = [9, 8, 7, 6, 5, 4, 3]
    assert pb.matched("c", toks, "", 3 * N, accept=lossy_accept(4.5)) == 3 * N   # vLLM holds pages 0..2
    pb.allocated("c", toks, len(toks), "", blocks, 3 * N)
    w = ConnectorWorker(store, CpuPagedKV(engine_caches(9), store.layout, "vec"), max_pages=8)
    step(w, pb.plan([("c", blocks, 3 * N)], [], {"c": len(toks) - 6 * N}))
    assert w.counters.loaded_tokens == 3 * N and w.load_errors() == set()
    w.close()


def test_an_early_frame_must_match_its_planned_job_in_what_it_accepts() -> None:
    from tierkv.integrations.vllm.plan import lossy_accept

    job = LoadJob("r", "", np.arange(2 * N, dtype=np.uint32), 0, (1, 2), 2, lend=False, accept="exact")
    assert job.same(dataclasses.replace(job)) and not job.same(dataclasses.replace(job, accept=lossy_accept(4.0)))
    assert not job.same(dataclasses.replace(job, lend=True))
    for bad in ("lossy:nan", "lossy:inf", "lossy:0.5", "lossy:99", "lossy:", "approx"):
        assert early.decode(encode(dataclasses.replace(job, accept=bad))[4:])[0].accept == "exact"


def test_an_edit_named_on_the_request_is_spliced_once_and_its_derived_pages_loaded(
        store: RemoteStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The planner splices the cached prompt a ``tierkv_edit`` directive names (once per
    request, however often vLLM asks), then counts the derived pages as for a spliced
    prompt; a bad directive, or no rotary embedding, is logged and the request served
    exact pages, never an error into vLLM."""
    from tierkv.splice.rope import Rope

    old = prompt(6.5, seed=23)
    serve_and_save(store, old)
    new = old[:20] + old[45:]                               # 25 tokens dropped at 20
    directive = {"start": 20, "removed": old[20:45], "inserted": 0}
    made: list[int] = []

    def rope() -> Rope:
        made.append(1)
        return Rope.from_theta(10000.0, D)
    pb = ConnectorPlanner(store, N, rope=rope)
    splices: list[int] = []
    real = store.splice
    def counted(*args: Any, **kw: Any) -> Any:
        splices.append(1)
        return real(*args, **kw)
    monkeypatch.setattr(store, "splice", counted)
    assert pb.matched("b", new, "", 0, accept="derived", edit=directive) == 4 * N
    assert pb.matched("b", new, "", 0, accept="derived", edit=directive) == 4 * N   # vLLM asks again: no splice
    assert splices == [1] and made == [1]
    found = store.origins(np.array(new, np.uint32))
    assert [(o.page, o.mode, o.delta) for o in found if o is not None] == [(1, "truncate", -25), (2, "truncate", -25),
                                                                          (3, "truncate", -25)]
    pb.finished("b")
    assert pb._edited == set()
    # An exact request does not splice; a bad directive and a missing rope are logged, not raised.
    assert pb.matched("c", new, "", 0, accept="exact", edit=directive) == N and splices == [1]
    with caplog.at_level("WARNING", logger="tierkv.integrations.vllm.plan"):
        assert pb.matched("d", new, "", 0, accept="derived", edit={"start": -1}) == 4 * N   # spliced earlier
        assert "start must be a token count" in caplog.text
        bare = ConnectorPlanner(store, N)
        other = old[:30] + old[50:]
        assert bare.matched("e", other, "", 0, accept="derived",
                            edit={"start": 30, "removed": old[30:50], "inserted": 0}) == N
        assert "without the model's rotary embedding" in caplog.text
        def unreadable() -> Rope:
            raise RuntimeError("no such model type")   # what a config transformers cannot build may raise
        broken = ConnectorPlanner(store, N, rope=unreadable)
        assert broken.matched("f", other, "", 0, accept="derived",
                              edit={"start": 30, "removed": old[30:50], "inserted": 0}) == N
        assert "rotary embedding cannot be read" in caplog.text
    assert splices == [1]


def test_a_derived_request_with_vllms_own_hit_saves_nothing(store: RemoteStore) -> None:
    """With vLLM's prefix cache on, a derived request's own cache_salt may hold blocks an
    earlier derived request loaded: a request that starts from such a hit saves nothing,
    even where it loads nothing from tierkv or only exact pages."""
    toks = prompt(4.5, seed=31)
    put_pages(store, toks[:3 * N])
    pb = ConnectorPlanner(store, N)
    for num_computed, num_external in ((4 * N, 0), (N, 2 * N)):
        rid = f"r{num_computed}"
        pb.matched(rid, toks, "", num_computed, accept="derived")
        blocks = [5, 6, 7, 8, 9]
        pb.allocated(rid, toks, len(toks), "", blocks, num_external)
        plan = pb.plan([(rid, blocks, num_computed + num_external)], [], {rid: len(toks) - num_computed - num_external})
        assert plan.saves == [], (num_computed, num_external)
        assert all(j.accept == "derived" for j in plan.loads)
        pb.finished(rid)
    # The same without vLLM's hit: exact pages loaded, the rest computed and saved.
    pb.matched("x", toks, "", 0, accept="derived")
    pb.allocated("x", toks, len(toks), "", [5, 6, 7, 8, 9], 3 * N)
    plan = pb.plan([("x", [5, 6, 7, 8, 9], 3 * N)], [], {"x": len(toks) - 3 * N})
    assert [j.accept for j in plan.loads] == ["exact"] and plan.saves and plan.saves[0].first == 3
    pb.finished("x")


def test_a_replacement_named_on_the_request_loads_exact_pages_and_saves_what_it_computes(store: RemoteStore) -> None:
    """A replacement's derived pages start after the pages vLLM must compute (it loads a
    prefix only): the request loads the exact pages before the edit, and what it computes
    from there is exact, so it is saved (a request that loaded derived pages saves nothing)."""
    from tierkv.splice.rope import Rope

    old = prompt(6.5, seed=29)
    serve_and_save(store, old)
    new = old[:20] + [7, 7, 7, 7, 7, 7, 7, 7, 7, 7] + old[30:]    # 10 tokens replaced by 10 others at 20
    pb = ConnectorPlanner(store, N, rope=lambda: Rope.from_theta(10000.0, D))
    directive = {"start": 20, "removed": old[20:30], "inserted": 10}
    assert pb.matched("r", new, "", 0, accept="derived", edit=directive) == N   # the page before the edit
    derived = store.lookup(np.array(new, np.uint32), accept="derived")
    assert derived.cached_pages == 1 and derived.derived == 0   # derived pages from page 2: not reached yet
    blocks = [9, 8, 7, 6, 5, 4, 3]
    pb.allocated("r", new, len(new), "", blocks, N)
    plan = pb.plan([("r", blocks, N)], [], {"r": len(new) - N})
    (job,) = plan.loads
    assert job.accept == "exact" and job.end == 1
    assert plan.saves and plan.saves[0].first == 1        # computed over exact pages only: stored
    pb.finished("r")


@pytest.mark.parametrize("directive, prompt_len, message", [
    ([1, 2], 10, "must be"),
    ({"begin": 1}, 10, "must be"),
    ({"start": 1, "removed": [1], "inserted": 0, "extra": 1}, 10, "must be"),
    ({"start": True, "removed": [1]}, 10, "start must be a token count"),
    ({"start": 1, "inserted": -2, "removed": [1]}, 10, "inserted must be a token count"),
    ({"start": 1, "removed": "abc"}, 10, "removed must be a list"),
    ({"start": 1, "removed": [1, -1]}, 10, "removed must be a list"),
    ({"start": 1, "removed": [1, 1 << 32]}, 10, "removed must be a list"),
    ({"start": 8, "removed": [], "inserted": 3}, 10, "passes the prompt's 10 tokens"),
    ({"start": 3}, 10, "removes or inserts something"),
    ({"start": 1, "removed": [[1], [1, 2]]}, 10, "removed must be a list"),      # ragged: numpy refuses it
    ({"start": 1, "removed": [1, [2]]}, 10, "removed must be a list"),
    ({"start": 1, "removed": [[1, 2]]}, 10, "removed must be a list"),
    ({"start": 1, "removed": [1.5]}, 10, "removed must be a list"),
    ({"start": 1, "removed": None}, 10, "removed must be a list"),
    ({"start": 1, "removed": [10 ** 30]}, 10, "removed must be a list"),
    ({"start": None, "removed": [1]}, 10, "start must be a token count"),
    ({"start": 1.0, "removed": [1]}, 10, "start must be a token count"),
])
def test_a_bad_edit_directive_says_what_was_expected(directive: object, prompt_len: int, message: str) -> None:
    from tierkv.integrations.vllm.edits import Edit

    with pytest.raises(InputError, match=message):
        Edit.parse(directive, prompt_len)


def test_an_edit_rebuilds_the_cached_prompt() -> None:
    from tierkv.integrations.vllm.edits import Edit

    new = [1, 2, 7, 8, 9, 5, 6]                  # [3, 4] replaced by [7, 8, 9] at 2
    e = Edit.parse({"start": 2, "removed": [3, 4], "inserted": 3}, len(new))
    assert e.cached_prompt(new).tolist() == [1, 2, 3, 4, 5, 6] and e.replacement(new).tolist() == [7, 8, 9]
    d = Edit.parse({"start": 2, "removed": [3, 4]}, 4)   # a deletion: inserted defaults to 0
    assert d.cached_prompt([1, 2, 5, 6]).tolist() == [1, 2, 3, 4, 5, 6] and d.replacement([1, 2, 5, 6]).size == 0


def test_pages_not_all_in_dram_are_got_layer_by_layer_not_lent(store: RemoteStore, daemon: NodeService) -> None:
    toks = prompt(4.5, seed=13)
    src = engine_caches(13)
    a = ConnectorWorker(store, CpuPagedKV(src, store.layout, "vec"), max_pages=8)
    pa = ConnectorPlanner(store, N)
    pa.allocated("a", toks, len(toks), "", [0, 1, 2, 3, 4], 0)
    step(a, pa.plan([("a", [0, 1, 2, 3, 4], 0)], [], {"a": len(toks)}), write=src, caches=a.kv.layers)
    a.drain()
    for k in range(3):                                       # 12 other pages push these 4 out of DRAM
        other = prompt(4.5, seed=100 + k)
        put_pages(store, other)
    tiers = daemon.store.lookup(np.array(toks[:4 * N], np.uint32)).tiers
    assert TierKind.NVME in tiers
    b_caches = engine_caches(14)
    b = ConnectorWorker(store, CpuPagedKV(b_caches, store.layout, "vec"), max_pages=8)
    lends: list[object] = []
    real_lend = store.lend

    def lend(*a: object, **k: object) -> object:
        lends.append(a)
        return real_lend(*a, **k)  # type: ignore[arg-type]
    store.lend = lend  # type: ignore[method-assign,assignment]
    pb = ConnectorPlanner(store, N)
    assert pb.matched("b", toks, "", 0) == 4 * N
    pb.allocated("b", toks, len(toks), "", [9, 8, 7, 6, 5], 4 * N)
    plan = pb.plan([("b", [9, 8, 7, 6, 5], 4 * N)], [], {"b": len(toks) - 4 * N})
    assert [job.lend for job in plan.loads] == [False]       # the lookup saw pages below DRAM
    step(b, plan)
    assert lends == []                                       # so no lend was tried first
    assert b.load_errors() == set()
    for layer in range(L):
        assert torch.equal(b_caches[layer][[9, 8, 7, 6]], src[layer][[0, 1, 2, 3]])
    assert b.counters.lent_tokens == 0 and b.counters.tokens_by_tier.get("nvme", 0) > 0
    a.close()
    b.close()


def test_pages_the_store_cannot_serve_are_reported_for_recompute(store: RemoteStore) -> None:
    toks = prompt(4.5, seed=12)
    put_pages(store, toks[: 2 * N])                         # only 2 of the 4 claimed pages exist
    caches = engine_caches(6)
    before = [c.clone() for c in caches]
    w = ConnectorWorker(store, CpuPagedKV(caches, store.layout, "vec"), max_pages=8)
    p = ConnectorPlanner(store, N)
    p.allocated("r", toks, len(toks), "", [1, 2, 3, 4, 5], 4 * N)
    step(w, p.plan([("r", [1, 2, 3, 4, 5], 4 * N)], [], {"r": len(toks) - 4 * N}))
    assert w.load_errors() == {3, 4}
    assert w.load_errors() == set()                          # reported once
    assert w.counters.failed_load_tokens == 2 * N
    for layer in range(L):
        assert torch.equal(caches[layer][[3, 4]], before[layer][[3, 4]])   # nothing half-written there
    w.close()


def test_jobs_beyond_the_buffers_are_skipped_not_deadlocked(store: RemoteStore) -> None:
    w = ConnectorWorker(store, CpuPagedKV(engine_caches(7), store.layout, "vec"), max_pages=4, buffers=2)
    p = ConnectorPlanner(store, N)
    reqs = {f"r{i}": prompt(2.5, seed=20 + i) for i in range(3)}
    for i, (rid, toks) in enumerate(reqs.items()):
        p.allocated(rid, toks, len(toks), "", [3 * i, 3 * i + 1, 3 * i + 2], 0)
    plan = p.plan([(rid, [3 * i, 3 * i + 1, 3 * i + 2], 0) for i, rid in enumerate(reqs)], [],
                  {rid: len(t) for rid, t in reqs.items()})
    assert len(plan.saves) == 3
    step(w, plan)
    w.drain()
    assert w.counters.skipped_saves == 1 and w.counters.saved_pages == 4
    too_long = prompt(6.5, seed=30)                          # over max_pages: neither loaded nor saved
    put_pages(store, too_long)
    p.allocated("long", too_long, len(too_long), "", list(range(7)), 6 * N)
    step(w, p.plan([("long", list(range(7)), 6 * N)], [], {"long": N // 2}))
    assert w.load_errors() == set(range(6))
    w.close()


def test_a_layer_vllm_never_waited_for_is_copied_late_and_its_blocks_recomputed(store: RemoteStore) -> None:
    toks = prompt(3.5, seed=40)
    src = engine_caches(8)
    put = np.zeros((3, LAYOUT.page_bytes), np.uint8)
    kv_src = CpuPagedKV(src, store.layout, "vec")
    pages = kv_src.pages(torch.from_numpy(put))
    for layer in range(L):
        kv_src.gather(layer, [0, 1, 2], pages)
    store.put(np.array(toks[: 3 * N], np.uint32), put)
    caches = engine_caches(9)
    w = ConnectorWorker(store, CpuPagedKV(caches, store.layout, "vec"), max_pages=8)
    p = ConnectorPlanner(store, N)
    p.allocated("r", toks, len(toks), "", [4, 5, 6, 7], 3 * N)
    w.begin_step(p.plan([("r", [4, 5, 6, 7], 3 * N)], [], {"r": N // 2}))
    w.start_load()
    w.wait_layer(0)                                          # vLLM skipped the waits of layers 1 and 2
    w.end_step()
    assert w.load_errors() == {4, 5, 6}                      # the step read blocks before their copy
    for layer in range(L):                                   # the copies still landed
        assert torch.equal(caches[layer][[4, 5, 6]], src[layer][[0, 1, 2]])
    w.close()


def stored_pages(store: RemoteStore, tokens: list[int]) -> int:
    return store.lookup(np.array(tokens[: len(tokens) // N * N], np.uint32), count=False).cached_pages


def test_a_save_computed_over_a_failed_load_is_not_stored(store: RemoteStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Review: a request loads pages 0-3 and computes page 4 in one step; the get fails
    (the pages are still in the store). Blocks 1-4 are recomputed by vLLM, and page 4,
    computed over stale blocks, must not reach the store under a valid key."""
    toks = prompt(5.5, seed=50)
    put_pages(store, toks[: 4 * N])
    w = ConnectorWorker(store, CpuPagedKV(engine_caches(10), store.layout, "vec"), max_pages=8)
    p = ConnectorPlanner(store, N)
    assert p.matched("r", toks, "", 0) == 4 * N
    p.allocated("r", toks, len(toks), "", [1, 2, 3, 4, 5, 6], 4 * N)
    plan = p.plan([("r", [1, 2, 3, 4, 5, 6], 4 * N)], [], {"r": len(toks) - 4 * N})
    assert [(s.first, s.end) for s in plan.saves] == [(4, 5)]

    def broken_get(*_a: object, **_k: object) -> None:
        raise TierKVError("the daemon did not answer in time")
    monkeypatch.setattr(store, "get", broken_get)
    monkeypatch.setattr(store, "lend", broken_get)
    step(w, plan)
    w.drain()
    assert w.load_errors() == {1, 2, 3, 4}
    assert w.counters.saved_pages == 0 and w.counters.skipped_saves == 1
    monkeypatch.undo()
    assert stored_pages(store, toks) == 4                   # page 4 is not in the store
    w.close()


def test_no_wait_at_all_still_reports_the_loads(store: RemoteStore) -> None:
    """Review: when vLLM waits for no layer at all, the copies land late and every loaded
    block is reported (the forward pass read them before)."""
    toks = prompt(3.5, seed=51)
    put_pages(store, toks)
    w = ConnectorWorker(store, CpuPagedKV(engine_caches(11), store.layout, "vec"), max_pages=8)
    p = ConnectorPlanner(store, N)
    p.matched("r", toks, "", 0)
    p.allocated("r", toks, len(toks), "", [7, 8, 9, 10], 3 * N)
    w.begin_step(p.plan([("r", [7, 8, 9, 10], 3 * N)], [], {"r": N // 2}))
    w.end_step()
    assert w.load_errors() == {7, 8, 9}
    w.close()


def test_an_unexpected_loader_failure_reports_the_blocks_and_returns_the_buffers(
        store: RemoteStore, monkeypatch: pytest.MonkeyPatch) -> None:
    toks = prompt(3.5, seed=52)
    put_pages(store, toks)
    w = ConnectorWorker(store, CpuPagedKV(engine_caches(12), store.layout, "vec"), max_pages=8, buffers=2)
    p = ConnectorPlanner(store, N)
    p.matched("r", toks, "", 0)
    p.allocated("r", toks, len(toks), "", [1, 2, 3, 4], 3 * N)

    def boom(*_a: object, **_k: object) -> None:
        raise RuntimeError("not a store error")
    monkeypatch.setattr(w, "_get", boom)
    monkeypatch.setattr(w, "_lend", boom)
    step(w, p.plan([("r", [1, 2, 3, 4], 3 * N)], [], {"r": N // 2}))
    assert w.load_errors() == {1, 2, 3}
    assert len(w._pool._free) == 2                           # both buffers back in the pool
    w.close()


def test_a_load_failing_after_another_was_lent_gives_the_lent_rows_back(
        store: RemoteStore, daemon: NodeService, monkeypatch: pytest.MonkeyPatch) -> None:
    reqs = {"a": prompt(2.5, seed=60), "b": prompt(2.5, seed=61)}
    for toks in reqs.values():
        put_pages(store, toks)
    w = ConnectorWorker(store, CpuPagedKV(engine_caches(15), store.layout, "vec"), max_pages=8)
    if w._dram is None:
        w.close()
        pytest.skip("this client is not lent the daemon's DRAM")
    p = ConnectorPlanner(store, N)
    for i, (rid, toks) in enumerate(reqs.items()):
        p.matched(rid, toks, "", 0)
        p.allocated(rid, toks, len(toks), "", [3 * i, 3 * i + 1, 3 * i + 2], 2 * N)
    real = w._lend

    def second_fails(load):  # type: ignore[no-untyped-def]
        if load.job.req_id == "b":
            raise RuntimeError("not a store error")
        return real(load)
    monkeypatch.setattr(w, "_lend", second_fails)
    step(w, p.plan([(rid, [3 * i, 3 * i + 1, 3 * i + 2], 2 * N) for i, rid in enumerate(reqs)], [],
                   {rid: N // 2 for rid in reqs}))
    assert w.load_errors() == {0, 1, 3, 4}
    w.close()                                                # its loader ends what it lent
    assert daemon.store._copying == 0                        # no DRAM row held back any more


def test_a_worker_lent_pages_by_a_restarted_daemon_reads_them_from_its_new_pool(sock_dir: Path,
                                                                                 tmp_path: Path) -> None:
    """Review: the worker mapped the first daemon's DRAM pool; after a restart a lend names
    rows of the new daemon's pool, which the worker must map and read, not the old one."""
    path = sock_dir / "p.sock"
    toks, filler = prompt(2.5, seed=70), prompt(3.5, seed=71)
    src = engine_caches(16)
    kv_src = CpuPagedKV(src, LAYOUT, "vec")
    pages = torch.zeros(2, LAYOUT.page_bytes, dtype=torch.uint8)
    for layer in range(L):
        kv_src.gather(layer, [5, 6], kv_src.pages(pages))
    cfg = StoreConfig(path=str(tmp_path / "a"), model_id="m", layout=LAYOUT, dram=DramConfig(8 * LAYOUT.page_bytes))
    svc = NodeService(cfg, path).start()
    store = RemoteStore(path, timeout_s=10)
    store.put(np.array(toks[:2 * N], np.uint32), pages.numpy())
    caches = engine_caches(17)
    w = ConnectorWorker(store, CpuPagedKV(caches, LAYOUT, "vec"), max_pages=8)
    p = ConnectorPlanner(store, N)
    p.matched("q", toks, "", 0)
    p.allocated("q", toks, len(toks), "", [4, 5, 6], 2 * N)
    step(w, p.plan([("q", [4, 5, 6], 2 * N)], [], {"q": N // 2}))    # lent by the first daemon
    assert w.counters.lent_tokens == 2 * N
    svc.close()
    cfg_b = StoreConfig(path=str(tmp_path / "b"), model_id="m", layout=LAYOUT, dram=DramConfig(8 * LAYOUT.page_bytes))
    svc = NodeService(cfg_b, path).start()
    put_pages(store, filler)                                          # other pages take the first rows here
    store.put(np.array(toks[:2 * N], np.uint32), pages.numpy())
    assert p.matched("r", toks, "", 0) == 2 * N
    p.allocated("r", toks, len(toks), "", [1, 2, 3], 2 * N)
    step(w, p.plan([("r", [1, 2, 3], 2 * N)], [], {"r": N // 2}))
    assert w.load_errors() == set() and w.counters.lent_tokens == 4 * N   # lent by the second daemon
    for layer in range(L):
        assert torch.equal(caches[layer][[1, 2]], src[layer][[5, 6]])
    w.close()
    store.close()
    svc.close()


def test_a_save_after_a_lost_page_starts_again_from_the_first_page(sock_dir: Path, tmp_path: Path) -> None:
    """Review: the planner moves on as if every save landed. Here the daemon restarts
    (DRAM only: its pages are gone), so the put of page 1 finds page 0 missing and stores
    nothing; the request's next save copies from page 0 again and all of it lands."""
    cfg = StoreConfig(path=str(tmp_path / "dram-only"), model_id="m", layout=LAYOUT,
                      dram=DramConfig(16 * LAYOUT.page_bytes))
    path = sock_dir / "r.sock"
    svc = NodeService(cfg, path).start()
    store = RemoteStore(path, timeout_s=10)
    toks = prompt(3.5, seed=53)
    src = engine_caches(13)
    w = ConnectorWorker(store, CpuPagedKV([c.clone() for c in src], LAYOUT, "vec"), max_pages=8)
    p = ConnectorPlanner(store, N)
    p.matched("r", toks, "", 0)
    p.allocated("r", toks, len(toks), "", [2, 3, 4, 5], 0)
    step(w, p.plan([("r", [2, 3, 4, 5], 0)], [], {"r": N}))           # page 0 lands
    w.drain()
    assert stored_pages(store, toks) == 1
    svc.close()
    svc = NodeService(cfg, path).start()                              # a new daemon: nothing stored
    step(w, p.plan([], [("r", None, False, N)], {"r": N}))            # page 1: its put finds no page 0
    w.drain()
    assert stored_pages(store, toks) == 0
    step(w, p.plan([], [("r", None, False, 2 * N)], {"r": N}))        # page 2: saved from page 0 again
    w.drain()
    assert stored_pages(store, toks) == 3
    got = np.zeros((3, LAYOUT.page_bytes), np.uint8)
    assert store.get(np.array(toks[: 3 * N], np.uint32), got).pages == 3
    ref = torch.zeros(3, LAYOUT.page_bytes, dtype=torch.uint8)
    kv = CpuPagedKV(src, LAYOUT, "vec")
    for layer in range(L):
        kv.gather(layer, [2, 3, 4], kv.pages(ref))
    assert np.array_equal(got, ref.numpy())
    w.close()
    store.close()
    svc.close()


# -- loads announced before their step (early.py) --------------------------------------------
def stored_src(store: RemoteStore, toks: list[int], seed: int, pages: int) -> list[torch.Tensor]:
    """Engine caches whose blocks 0..pages-1 are stored as the prompt's pages; returned."""
    src = engine_caches(seed)
    kv = CpuPagedKV(src, store.layout, "vec")
    buf = torch.zeros(pages, LAYOUT.page_bytes, dtype=torch.uint8)
    for layer in range(L):
        kv.gather(layer, list(range(pages)), kv.pages(buf))
    store.put(np.array(toks[: pages * N], np.uint32), buf.numpy())
    return src


def test_an_announced_load_starts_before_its_step_and_the_plan_takes_it(
        store: RemoteStore, monkeypatch: pytest.MonkeyPatch) -> None:
    toks = prompt(3.5, seed=80)
    src = stored_src(store, toks, 80, 3)
    caches = engine_caches(81)
    w = ConnectorWorker(store, CpuPagedKV(caches, store.layout, "vec"), max_pages=8)
    announced: list[bool] = []
    p = ConnectorPlanner(store, N, announce=lambda job: announced.append(w.start_early(job)))
    assert p.matched("r", toks, "", 0) == 3 * N
    p.allocated("r", toks, len(toks), "", [9, 2, 7, 1], 3 * N)
    assert announced == [True]                               # started when the scheduler decided it
    (load,) = w._early.values()
    assert load.future is not None
    load.future.result(timeout=10)                           # done before the step began

    def no_more(*_a: object, **_k: object) -> None:
        raise AssertionError("the step loaded the pages a second time")
    monkeypatch.setattr(store, "get", no_more)
    monkeypatch.setattr(store, "lend", no_more)
    plan = p.plan([("r", [9, 2, 7, 1], 3 * N)], [], {"r": N // 2})
    assert [j.serial for j in plan.loads] == [1] and plan.serial == 1
    step(w, plan)
    monkeypatch.undo()
    assert w.load_errors() == set()
    for layer in range(L):
        assert torch.equal(caches[layer][[9, 2, 7]], src[layer][[0, 1, 2]])
    assert (w.counters.early_loads, w.counters.unused_early_loads, w.counters.loaded_tokens) == (1, 0, 3 * N)
    assert w._early == {} and len(w._pool._free) == w._pool._made    # every buffer back
    w.close()


def test_an_announced_load_no_plan_takes_is_given_back_unused(store: RemoteStore, daemon: NodeService) -> None:
    toks = prompt(2.5, seed=82)
    stored_src(store, toks, 82, 2)
    caches = engine_caches(83)
    before = [c.clone() for c in caches]
    w = ConnectorWorker(store, CpuPagedKV(caches, store.layout, "vec"), max_pages=8)
    p = ConnectorPlanner(store, N, announce=w.start_early)
    p.matched("r", toks, "", 0)
    p.allocated("r", toks, len(toks), "", [4, 5, 6], 2 * N)
    p.plan([], [], {})                                       # the plan that carried it was lost
    step(w, StepPlan(serial=1))                              # a later plan has passed serial 1
    w.drain()
    w._loader.submit(lambda: None).result()                  # the give-back ran
    assert w._early == {} and len(w._pool._free) == w._pool._made
    assert (w.counters.early_loads, w.counters.unused_early_loads, w.counters.loaded_tokens) == (0, 1, 0)
    assert w.load_errors() == set()
    for layer in range(L):
        assert torch.equal(caches[layer], before[layer])     # nothing copied into vLLM's blocks
    assert daemon.store._copying == 0                        # a lend it took has ended
    w.close()


def test_an_announcement_after_its_plan_or_unlike_it_does_not_change_the_load(store: RemoteStore) -> None:
    toks = prompt(2.5, seed=84)
    src = stored_src(store, toks, 84, 2)
    caches = engine_caches(85)
    w = ConnectorWorker(store, CpuPagedKV(caches, store.layout, "vec"), max_pages=8)
    p = ConnectorPlanner(store, N)
    p.matched("r", toks, "", 0)
    p.allocated("r", toks, len(toks), "", [4, 5, 6], 2 * N)
    plan = p.plan([("r", [4, 5, 6], 2 * N)], [], {"r": N // 2})
    (job,) = plan.loads
    step(w, plan)
    assert w.start_early(job) is False and w._early == {}    # late: the step already loaded it
    # An announcement whose blocks differ from its plan's: the plan wins.
    p.matched("s", toks, "", 0)
    p.allocated("s", toks, len(toks), "", [7, 8, 9], 2 * N)
    plan = p.plan([("s", [7, 8, 9], 2 * N)], [], {"s": N // 2})
    (job,) = plan.loads
    before = [c.clone() for c in caches]
    assert w.start_early(dataclasses.replace(job, block_ids=(10, 11))) is True
    step(w, plan)
    assert w.load_errors() == set()
    for layer in range(L):
        assert torch.equal(caches[layer][[7, 8]], src[layer][[0, 1]])
        assert torch.equal(caches[layer][[10, 11]], before[layer][[10, 11]])   # the note's blocks untouched
    assert (w.counters.early_loads, w.counters.unused_early_loads) == (0, 1)
    w.close()
    assert len(w._pool._free) == w._pool._made


def test_announced_loads_a_worker_closes_with_are_given_back(store: RemoteStore, daemon: NodeService) -> None:
    toks = prompt(2.5, seed=86)
    stored_src(store, toks, 86, 2)
    w = ConnectorWorker(store, CpuPagedKV(engine_caches(87), store.layout, "vec"), max_pages=8, buffers=3)
    p = ConnectorPlanner(store, N, announce=w.start_early)
    for rid in ("a", "b", "c"):                              # one buffer stays for the next step: 2 start
        p.matched(rid, toks, "", 0)
        p.allocated(rid, toks, len(toks), "", [1, 2, 3], 2 * N)
    assert sorted(w._early) == [1, 2] and len(w._pool._free) == 1
    w.close()
    assert w._early == {} and len(w._pool._free) == 3
    assert daemon.store._copying == 0


def job(serial: int = 3, tokens: int = 2 * N) -> LoadJob:
    return LoadJob("req-7", "tenant", np.arange(tokens, dtype=np.uint32), 1, (4, 9), 5, lend=False, serial=serial)


def test_a_note_for_the_next_step_survives_this_steps_bind_and_another_planners_is_ignored(
        store: RemoteStore) -> None:
    """vLLM's async scheduling: step N+1's load may be announced before the worker binds
    step N's plan."""
    toks = prompt(2.5, seed=88)
    src = stored_src(store, toks, 88, 2)
    caches = engine_caches(89)
    w = ConnectorWorker(store, CpuPagedKV(caches, store.layout, "vec"), max_pages=8)
    p = ConnectorPlanner(store, N)
    step(w, p.plan([], [], {}))                              # step N-1: the worker learns the planner
    plan_n = p.plan([], [], {})                              # step N, planned before the load
    p.matched("r", toks, "", 0)
    p.allocated("r", toks, len(toks), "", [5, 6, 7], 2 * N)  # step N+1's load ...
    (job,) = p._loads
    assert w.start_early(job) is True                        # ... announced before N binds
    other = ConnectorPlanner(store, N)
    other.matched("x", toks, "", 0)
    other.allocated("x", toks, len(toks), "", [8, 9, 10], 2 * N)
    assert w.start_early(other._loads[0]) is False           # another planner's note (same serial)
    step(w, plan_n)
    assert list(w._early) == [job.serial]                    # still waiting for its plan
    step(w, p.plan([("r", [5, 6, 7], 2 * N)], [], {"r": N // 2}))
    assert w.load_errors() == set() and w.counters.early_loads == 1 and w.counters.unused_early_loads == 0
    for layer in range(L):
        assert torch.equal(caches[layer][[5, 6]], src[layer][[0, 1]])
    w.close()


def test_a_failed_load_fails_only_its_own_blocks_when_another_was_started_early(
        store: RemoteStore, monkeypatch: pytest.MonkeyPatch) -> None:
    reqs = {"a": prompt(2.5, seed=90), "b": prompt(2.5, seed=91)}
    srcs = {rid: stored_src(store, toks, 90 + i, 2) for i, (rid, toks) in enumerate(reqs.items())}
    caches = engine_caches(92)
    w = ConnectorWorker(store, CpuPagedKV(caches, store.layout, "vec"), max_pages=8)
    p = ConnectorPlanner(store, N)
    p.matched("a", reqs["a"], "", 0)
    p.allocated("a", reqs["a"], len(reqs["a"]), "", [0, 1, 2], 2 * N)
    assert w.start_early(p._loads[0]) is True               # a: announced, started early
    w._early[p._loads[0].serial].future.result(timeout=10)   # type: ignore[union-attr]
    p.matched("b", reqs["b"], "", 0)
    p.allocated("b", reqs["b"], len(reqs["b"]), "", [3, 4, 5], 2 * N)   # b: no note, loaded with the step

    def boom(*_a: object, **_k: object) -> None:
        raise RuntimeError("not a store error")
    monkeypatch.setattr(w, "_get", boom)
    monkeypatch.setattr(w, "_lend", boom)
    step(w, p.plan([("a", [0, 1, 2], 2 * N), ("b", [3, 4, 5], 2 * N)], [], {"a": N // 2, "b": N // 2}))
    assert w.load_errors() == {3, 4}                         # b's blocks only
    for layer in range(L):
        assert torch.equal(caches[layer][[0, 1]], srcs["a"][layer][[0, 1]])
    assert len(w._pool._free) == w._pool._made
    w.close()


def test_the_channel_carries_a_job_whole_and_a_send_without_listener_never_raises(
        sock_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(early, "SEND_TIMEOUT_S", 10.0)       # large frames on a busy machine: no drop
    addr = channel_address(f"engine-{sock_dir.name}")
    assert len(addr) < 108 and addr.startswith(b"\0")
    sender = EarlySender(addr)
    sender.send(job())                                       # nobody listens: dropped, not raised
    assert (sender.sent, sender.dropped) == (0, 1)
    got: list[LoadJob] = []
    listener = EarlyListener(addr, lambda j, sent: got.append(j))
    with pytest.raises(OSError):                             # one listener per engine
        EarlyListener(addr, lambda j, sent: got.append(j))
    sender._next_try = 0.0
    for s in (3, 4):
        sender.send(job(s, tokens=5000 * N))                 # 80,000 tokens: frames larger than a socket buffer
    assert wait_for(lambda: len(got) == 2)
    assert got[0].same(job(3, tokens=5000 * N)) and got[1].serial == 4 and got[0].lend is False
    # A malformed frame closes its connection only; the next sender is heard.
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect(addr)
    raw.sendall(struct.pack("<I", 9) + b"not json!")
    assert raw.recv(1) == b""                                # the listener hung up
    raw.close()
    again = EarlySender(addr)
    again.send(job(5))
    assert wait_for(lambda: len(got) == 3)
    listener.close()
    sender.close()
    again.close()


def test_the_scheduler_sends_nothing_to_a_listener_of_another_user(sock_dir: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    addr = channel_address(f"squat-{sock_dir.name}")
    got: list[LoadJob] = []
    listener = EarlyListener(addr, lambda j, sent: got.append(j))   # bound first, by "another user"
    monkeypatch.setattr(early.os, "getuid", lambda: os.geteuid() + 4242)   # the scheduler's uid differs
    sender = EarlySender(addr)
    sender.send(job())
    assert (sender.sent, sender.dropped) == (0, 1) and sender._next_try == float("inf")
    monkeypatch.undo()
    sender.send(job())                                       # and never tries that socket again
    assert sender.sent == 0 and got == []
    listener.close()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to send as another user")
def test_the_channel_hears_no_other_user(sock_dir: Path) -> None:
    addr = channel_address(f"other-{sock_dir.name}")
    got: list[LoadJob] = []
    listener = EarlyListener(addr, lambda j, sent: got.append(j))
    pid = os.fork()
    if pid == 0:   # the child: another user sends a job
        try:
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(addr)
            s.sendall(encode(job()))
            s.recv(1)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert wait_for(lambda: listener.refused == 1)
    assert got == []
    listener.close()


@pytest.mark.parametrize("order, loader", [("vllm_cpu_amx", "amx"), ("standard", "amx"), ("standard", "vec")])
def test_amx_blocks_saved_through_a_daemon_load_bit_for_bit(sock_dir: Path, tmp_path: Path, order: str,
                                                            loader: str) -> None:
    """An engine on an AMX CPU saves its blocks through a daemon; another loads them: an
    AMX engine gets the same bytes back (whole blocks in ``vllm_cpu_amx``, unpacked and
    packed again in ``standard``), and through the standard order an engine whose kernel
    is ``vec`` (a CPU without AMX) gets the same K and V in its own packing."""
    layout = KVLayout(L, H, DA, "bf16", NA, page_order=order)
    cfg = StoreConfig(path=str(tmp_path / "store"), model_id="m", layout=layout,
                      dram=DramConfig(16 * layout.page_bytes))
    g = torch.Generator().manual_seed(21)
    src = [torch.randn(8, H, NA, 2 * DA, generator=g).to(torch.bfloat16) for _ in range(L)]
    toks = list(np.random.default_rng(21).integers(0, 50_000, 3 * NA + 5))
    with NodeService(cfg, sock_dir / "amx.sock").start() as svc, RemoteStore(svc.path, timeout_s=10) as store:
        a = ConnectorWorker(store, CpuPagedKV([torch.zeros_like(c) for c in src], layout, "amx"), max_pages=8)
        pa = ConnectorPlanner(store, NA)
        pa.allocated("a", toks, len(toks), "", [5, 2, 6, 0], 0)
        step(a, pa.plan([("a", [5, 2, 6, 0], 0)], [], {"a": len(toks)}), write=src, caches=a.kv.layers)
        a.drain()
        assert a.counters.saved_pages == 3 and a.counters.failed_saves == 0
        dst = [torch.zeros_like(c) for c in src]
        b = ConnectorWorker(store, CpuPagedKV(dst, layout, loader), max_pages=8)
        pb = ConnectorPlanner(store, NA)
        assert pb.matched("b", toks, "", 0) == 3 * NA
        pb.allocated("b", toks, len(toks), "", [1, 3, 4, 7], 3 * NA)
        step(b, pb.plan([("b", [1, 3, 4, 7], 3 * NA)], [], {"b": len(toks) - 3 * NA}))
        assert b.load_errors() == set() and b.counters.loaded_tokens == 3 * NA
        if loader == "amx":
            for layer in range(L):
                assert torch.equal(dst[layer][[1, 3, 4]], src[layer][[5, 2, 6]])
        else:   # vec blocks: K transposed [D, N], V [N, D] a plane; src's by the AMX element formula
            for (mine, theirs), layer, h in itertools.product(zip([1, 3, 4], [5, 2, 6]), range(L), range(H)):
                plane = src[layer][theirs, h].reshape(2 * NA * DA)
                got = dst[layer][mine, h].reshape(2 * NA * DA)
                k_at, v_at = zip(*(amx_element(n, d) for d in range(DA) for n in range(NA)))
                assert torch.equal(got[:NA * DA], plane[list(k_at)])            # K^T: d-major, n inside
                v_in_vec = [n * DA + d for d in range(DA) for n in range(NA)]   # the same (d, n) order in V
                assert torch.equal(got[NA * DA:][v_in_vec], plane[list(v_at)])
        a.close()
        b.close()


def test_a_requests_ids_are_converted_once_and_as_a_whole_conversion_gives_them() -> None:
    """Saves take a request's leading ids from _Request.leading, which converts only the
    tokens after those it holds: the same ids as converting the whole prefix, views it
    gave before unchanged as it grows, fewer where the list is shorter, InputError (as
    any conversion) for a bad id."""
    from tierkv.integrations.vllm.plan import _Request, leading_ids

    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 50000, 10_000).tolist()
    live = tokens[:100]   # vLLM's list, extended as the request goes
    req = _Request("", live, 100)
    taken = []
    for n in (0, 16, 48, 48, 100, 64):
        taken.append((n, req.leading(n)))
    live.extend(tokens[100:])
    for n in (112, 2048, 2049, 9000, 10_000, 12_000, 5):
        taken.append((n, req.leading(n)))
    for n, ids in taken:   # each view still holds what it held
        assert ids.dtype == np.dtype("<u4") and np.array_equal(ids, leading_ids(tokens, min(n, len(tokens))))
    bad = _Request("", [1, 2, 3, -4], 4)
    assert np.array_equal(bad.leading(3), [1, 2, 3])
    with pytest.raises(InputError, match="token ids must lie in"):
        bad.leading(4)
