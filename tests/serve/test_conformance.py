"""One API, two backends: every test here runs against an in-process ``Store`` and against
the same store served by a daemon (``NodeService``) and reached with ``Store.connect``.
The last test runs random sessions on both at once and requires identical results,
errors and counters, call by call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import LAYOUT, PB, make_config, page_data
from tests.serve.conftest import AnyStore, Opened
from tierkv.errors import CapacityError, InputError, StoreClosedError, TierKVError
from tierkv.tiers.base import TierKind

TPP = LAYOUT.tokens_per_page


def prompt(seed: int, pages: int) -> np.ndarray:
    return np.random.default_rng(seed + 1000).integers(0, 50000, pages * TPP, dtype=np.int64)


def load(store: AnyStore, tokens: np.ndarray, n: int) -> tuple[int, np.ndarray]:
    out = np.zeros((n, PB), dtype=np.uint8)
    return store.get(tokens, out).pages, out


@pytest.mark.parametrize("dram,nvme", [(8, 0), (0, 8), (4, 16)])
def test_round_trip_each_tier(opened: Opened, tmp_path: Path, dram: int, nvme: int) -> None:
    s = opened(make_config(tmp_path / "s", dram, nvme))
    tokens, data = prompt(1, 4), page_data(1, 4)
    assert s.put(tokens, data).stored == 4
    n, out = load(s, tokens, 4)
    assert n == 4 and np.array_equal(out, data)
    assert s.lookup(tokens).tiers == ((TierKind.DRAM if dram else TierKind.NVME),) * 4


def test_torch_pages_in_layout_dtype(opened: Opened, tmp_path: Path) -> None:
    s = opened(make_config(tmp_path / "s"))
    tokens = prompt(2, 3)
    pages = torch.randn(3, *LAYOUT.page_shape).to(torch.bfloat16)
    assert s.put(tokens, pages).stored == 3
    out = torch.zeros_like(pages)
    assert s.get(tokens, out).pages == 3
    assert torch.equal(out.view(torch.int16), pages.view(torch.int16))


def test_put_takes_a_list_of_separate_pages(opened: Opened, tmp_path: Path) -> None:
    s = opened(make_config(tmp_path / "s", 2, 16))
    tokens, data = prompt(11, 6), page_data(11, 6)
    as_bf16 = torch.from_numpy(data.copy()).view(torch.bfloat16).reshape(6, *LAYOUT.page_shape)
    listed = [data[0].copy(), data[1:2].copy(), torch.from_numpy(data[2].copy()), as_bf16[3].clone(),
              torch.from_numpy(data[4:5].copy()), as_bf16[5:6].clone()]
    assert (s.put(tokens, listed).stored, s.put(tokens, tuple(listed)).already_present) == (6, 6)
    n, out = load(s, tokens, 6)
    assert n == 6 and np.array_equal(out, data)


BAD_CALLS: list[tuple[str, Callable[[AnyStore], object], type[Exception], str]] = [
    ("float page", lambda s: s.put(prompt(7, 8), [np.zeros(PB, np.float32)]), InputError,
     r"put\(pages=...\)\[0\]: a numpy page must be raw bytes"),
    ("str pages", lambda s: s.put(prompt(7, 8), "not pages"),  # type: ignore[arg-type]
     InputError, "or a list or tuple of pages, got str"),
    ("too many pages", lambda s: s.put(prompt(7, 2), np.zeros((3, PB), np.uint8)), InputError, "full pages"),
    ("strided", lambda s: s.put(prompt(7, 8), np.zeros((2, 2 * PB), np.uint8)[:, ::2]), InputError, "C-contiguous"),
    ("2-d tokens", lambda s: s.lookup(np.zeros((2, 16), np.int64)), InputError, "one-dimensional"),
    ("negative token", lambda s: s.lookup(np.array([-1] * 16)), InputError, "token ids must lie in"),
    ("float tokens", lambda s: s.lookup(np.zeros(16, np.float32)), InputError, "must be integers"),
    # a long prompt's ids are checked in one pass with their narrowing, past the first miss too
    ("negative token late in a long prompt", lambda s: s.lookup(np.array([5] * 9000 + [-1])), InputError,
     r"got values in \[-1, 5\]"),
    ("token past uint32 in a long uint64 prompt", lambda s: s.lookup(np.array([5] * 9000 + [1 << 32], np.uint64)),
     InputError, "4294967296"),
    ("bad tenant", lambda s: s.lookup(prompt(1, 1), tenant=3),  # type: ignore[arg-type]
     InputError, "tenant salt must be str or bytes"),
    ("get into a list", lambda s: s.get(prompt(1, 1), [np.zeros(PB, np.uint8)]),  # type: ignore[arg-type]
     InputError,
     "one batch buffer"),
    ("read-only out", lambda s: s.get(prompt(1, 1), _read_only_rows(1)), InputError, "read-only"),
    ("requested below rows", lambda s: s.get(prompt(1, 2), np.zeros((2, PB), np.uint8), requested=1), InputError,
     "requested must be an integer >= the 2 rows"),
    ("requested bool", lambda s: s.get(prompt(1, 2), np.zeros((2, PB), np.uint8), requested=True), InputError,
     "requested must be an integer"),
    ("unfilled too many", lambda s: s.put(prompt(1, 2), np.zeros((2, PB), np.uint8), unfilled=3), InputError,
     "unfilled must be an integer from 0 to the 2 rows"),
    ("unfilled negative", lambda s: s.put(prompt(1, 2), np.zeros((2, PB), np.uint8), unfilled=-1), InputError,
     "unfilled must be an integer"),
    ("more pages than all tiers", lambda s: s.put(prompt(1, 30), np.zeros((30, PB), np.uint8)), CapacityError,
     "all tiers together hold 20"),
]


def _read_only_rows(n: int) -> np.ndarray:
    rows = np.zeros((n, PB), np.uint8)
    rows.flags.writeable = False
    return rows


@pytest.mark.parametrize("what,call,exc,match", BAD_CALLS, ids=[b[0] for b in BAD_CALLS])
def test_bad_input_raises_the_same_error(opened: Opened, tmp_path: Path, what: str,
                                         call: Callable[[AnyStore], object], exc: type[Exception], match: str) -> None:
    s = opened(make_config(tmp_path / "s"))
    with pytest.raises(exc, match=match):
        call(s)
    assert s.stats().pages_stored == 0
    tokens, data = prompt(3, 2), page_data(3, 2)   # and the store (and the connection) still work
    assert s.put(tokens, data).stored == 2 and load(s, tokens, 2)[0] == 2


def test_demotion_and_promotion_are_bit_exact(opened: Opened, tmp_path: Path) -> None:
    s = opened(make_config(tmp_path / "s"))
    prompts = [(prompt(i, 2), page_data(i, 2)) for i in range(6)]  # 12 pages, DRAM holds 4
    for tokens, data in prompts:
        s.put(tokens, data)
    assert s.stats().bytes_moved.get("dram->nvme", 0) > 0
    tokens, data = prompts[0]
    assert s.lookup(tokens).tiers == (TierKind.NVME, TierKind.NVME)
    n, out = load(s, tokens, 2)
    assert n == 2 and np.array_equal(out, data)
    assert s.lookup(tokens).tiers == (TierKind.DRAM, TierKind.DRAM)
    for tokens, data in prompts:
        n, out = load(s, tokens, 2)
        assert n == 2 and np.array_equal(out, data)


def test_partial_prefix_extension_and_untouched_rows(opened: Opened, tmp_path: Path) -> None:
    s = opened(make_config(tmp_path / "s"))
    tokens, data = prompt(3, 4), page_data(3, 4)
    s.put(tokens[: 2 * TPP + 5], data[:2])
    r = s.lookup(tokens)
    assert (r.cached_pages, r.cached_tokens, r.total_pages) == (2, 2 * TPP, 4)
    out = np.full((3, PB), 7, dtype=np.uint8)
    assert s.get(tokens, out).pages == 2
    assert np.array_equal(out[:2], data[:2]) and (out[2] == 7).all()
    res = s.put(tokens, data)
    assert (res.stored, res.already_present) == (2, 2)
    n, out = load(s, tokens, 4)
    assert n == 4 and np.array_equal(out, data)


def test_tenants_do_not_share_pages(opened: Opened, tmp_path: Path) -> None:
    s = opened(make_config(tmp_path / "s"))
    tokens = prompt(5, 2)
    s.put(tokens, page_data(5, 2), tenant="alice")
    assert s.lookup(tokens, tenant="alice").cached_pages == 2
    assert s.lookup(tokens, tenant=b"alice").cached_pages == 2   # a str salt is its UTF-8 bytes
    assert s.lookup(tokens, tenant="bob").cached_pages == 0
    assert s.lookup(tokens).cached_pages == 0


def test_prefetch_promotes_to_dram(opened: Opened, tmp_path: Path) -> None:
    s = opened(make_config(tmp_path / "s"))
    prompts = [(prompt(i, 2), page_data(i, 2)) for i in range(4)]
    for tokens, data in prompts:
        s.put(tokens, data)
    tokens, data = prompts[0]
    assert TierKind.NVME in s.lookup(tokens).tiers
    assert s.prefetch(tokens).result(timeout=30) == 2
    assert s.lookup(tokens).tiers == (TierKind.DRAM, TierKind.DRAM)
    n, out = load(s, tokens, 2)
    assert n == 2 and np.array_equal(out, data)


def test_a_bad_lookup_leaves_the_pins_held(opened: Opened, tmp_path: Path) -> None:
    """Bad ids are refused before a connected client sends anything: its connection, and
    the pins it holds, stay (a ragged list or a bfloat16 tensor once dropped them)."""
    s = opened(make_config(tmp_path / "s", 4, 0))
    s.put(prompt(0, 2), page_data(0, 2))
    assert s.pin(prompt(0, 2)) == 2
    for bad, match in (([1, [2]], "one-dimensional sequence of integers"),
                       (torch.arange(40, dtype=torch.bfloat16), "integers"),
                       (np.array([5] * 9000 + [-1]), "token ids must lie in")):
        with pytest.raises(InputError, match=match):
            s.lookup(bad)  # type: ignore[arg-type]
    assert s.unpin(prompt(0, 2)) == 2


def test_pins_hold_pages_until_released(opened: Opened, tmp_path: Path) -> None:
    s = opened(make_config(tmp_path / "s", 2, 0))
    s.put(prompt(0, 1), page_data(0, 1))
    assert s.pin(prompt(0, 1)) == 1
    for i in range(1, 8):
        s.put(prompt(i, 1), page_data(i, 1))
    assert s.lookup(prompt(0, 1)).cached_pages == 1
    assert (s.unpin(prompt(0, 1)), s.unpin(prompt(0, 1))) == (1, 0)
    for i in range(8, 12):
        s.put(prompt(i, 1), page_data(i, 1))
    assert s.lookup(prompt(0, 1)).cached_pages == 0
    with pytest.raises(InputError):
        s.pin(np.zeros((1, 16), np.int64))


def test_stats_count_the_calls(opened: Opened, tmp_path: Path) -> None:
    s = opened(make_config(tmp_path / "s"))
    tokens, data = prompt(9, 3), page_data(9, 3)
    s.put(tokens, data)
    s.lookup(tokens)
    s.lookup(tokens, count=False)
    load(s, np.concatenate([tokens, prompt(10, 1)]), 4)
    st = s.stats()
    assert (st.lookups, st.pages_requested, st.pages_hit, st.pages_stored) == (1, 4, 3, 3)
    assert st.hit_rate == 0.75 and st.misses == 1
    assert st.tiers["dram"].used_slots == 3 and st.tiers["dram"].occupancy == 0.75
    assert st.bytes_moved["dram->caller"] == 3 * PB
    s.flush()


def test_a_closed_store_raises_store_closed(opened: Opened, tmp_path: Path) -> None:
    s = opened(make_config(tmp_path / "s"))
    tokens = prompt(1, 1)
    s.put(tokens, page_data(1, 1))
    s.close()
    s.close()   # twice is fine
    for call in (lambda: s.lookup(tokens), lambda: load(s, tokens, 1), lambda: s.put(tokens, page_data(1, 1)),
                 lambda: s.prefetch(tokens), lambda: s.pin(tokens), lambda: s.flush()):
        with pytest.raises(StoreClosedError):
            call()


# -- the two backends side by side -----------------------------------------------------


def _outcome(call: Callable[[], object]) -> object:
    try:
        return call()
    except TierKVError as exc:
        return (type(exc).__name__, str(exc))


def _comparable_stats(s: AnyStore) -> dict[str, object]:
    d: dict[str, Any] = s.stats().to_dict()
    d.pop("seconds_moved")
    # The index file grows with its transactions, and the group commit's windows are timed.
    assert d.pop("index_file_bytes") > 0
    for t in d["tiers"].values():
        t.pop("io_seconds")
    return d


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("policy", ["lru", "lru-leaf"])
def test_random_sessions_match_call_for_call(sock_dir: Path, tmp_path: Path, seed: int, policy: str) -> None:
    """Random puts (batches, lists, partial and grown prompts, tenants), gets (short and
    long buffers), lookups, pins, unpins and prefetches on a small DRAM + NVMe store, the
    same on both backends: every result, every error and the final counters equal."""
    both = [Opened("in-process", sock_dir), Opened("connected", sock_dir)]
    try:
        stores = [o(make_config(tmp_path / f"s{i}", 3, 12, policy=policy)) for i, o in enumerate(both)]
        rng = np.random.default_rng(seed)
        prompts = [prompt(seed * 100 + i, int(rng.integers(1, 5))) for i in range(6)]
        stats = {"hits": 0, "mixed": 0}
        for step in range(300):
            p = int(rng.integers(len(prompts)))
            tokens = prompts[p]
            if rng.random() < 0.3:   # a prefix, possibly with a partial page
                tokens = tokens[: int(rng.integers(0, len(tokens) + 1))]
            if rng.random() < 0.15:  # a prompt that grows
                prompts[p] = tokens = np.concatenate([tokens, prompt(seed * 1000 + step, 1)])
            tenant: str | bytes = ("", "", "", "", "t1", b"t2")[int(rng.integers(6))]
            n = len(tokens) // TPP
            op = rng.choice(["put", "put-list", "get", "lookup", "pin", "unpin", "prefetch", "bad"],
                            p=[0.25, 0.1, 0.3, 0.1, 0.07, 0.07, 0.06, 0.05])
            announce = bool(rng.random() < 0.8)
            data = np.stack([page_data(int(t), 1)[0] for t in tokens[::TPP][:n]]) if n else np.zeros((0, PB),
                                                                                                  np.uint8)
            rows = n + 1 if rng.random() < 0.1 else int(rng.integers(0, n + 1))
            results: list[Any] = []
            for s in stores:
                if op == "put":
                    results.append(_outcome(lambda: s.put(tokens, data, tenant, announce=announce)))
                elif op == "put-list":
                    results.append(_outcome(lambda: s.put(tokens, list(data), tenant)))
                elif op == "get":
                    out = np.zeros((rows, PB), np.uint8)
                    got = _outcome(lambda: s.get(tokens, out, tenant))
                    k = getattr(got, "pages", 0)
                    results.append((got, out[:k].tobytes()))
                elif op == "lookup":
                    results.append(_outcome(lambda: s.lookup(tokens, tenant)))
                elif op == "pin":
                    results.append(_outcome(lambda: s.pin(tokens, tenant)))
                elif op == "unpin":
                    results.append(_outcome(lambda: s.unpin(tokens, tenant)))
                elif op == "prefetch":
                    results.append(_outcome(lambda: s.prefetch(tokens, tenant).result(timeout=30)))
                else:
                    bad: Any = data[:, :PB // 2] if n else "x"   # not C-contiguous, or not pages
                    results.append(_outcome(lambda: s.put(tokens, bad, tenant)))
            assert results[0] == results[1], f"step {step}: {op} gave {results[0]!r} in-process, {results[1]!r} served"
            if op == "get":
                got = results[0][0]
                k = getattr(got, "pages", 0)
                assert results[0][1] == data[:k].tobytes()
                stats["hits"] += k > 0
                stats["mixed"] += len(set(getattr(got, "tiers", ()))) > 1
        assert stats["hits"] >= 10 and stats["mixed"] >= 1, stats   # the session reached every tier
        assert _comparable_stats(stores[0]) == _comparable_stats(stores[1])
    finally:
        for o in both:
            o.close()


def test_a_long_prompt_cached_across_stretches(opened: Opened, tmp_path: Path) -> None:
    """A lookup hashes a stretch of pages at a time (64, then 512, then 4,096): prefixes
    that end on either side of a stretch's end, and ids found out of range in a later
    stretch (through a daemon, written after the request went), mean what they mean
    in-process."""
    s = opened(make_config(tmp_path / "s", 700, 0))
    tokens = np.random.default_rng(4).integers(0, 50000, 5000 * TPP, dtype=np.int64)
    data = page_data(22, 600)
    assert s.put(tokens[:600 * TPP], data).stored == 600
    for pages in (63, 64, 65, 575, 576, 577, 600, 5000):
        r = s.lookup(tokens[:pages * TPP + 3])
        assert (r.cached_pages, r.total_pages) == (min(pages, 600), pages)
    shifted = tokens.copy()
    shifted[580 * TPP] += 1    # in the third stretch
    assert s.lookup(shifted).cached_pages == 580
    bad = tokens.copy()
    for at in (100 * TPP, 590 * TPP, 4000 * TPP, bad.size - 1):   # cached, cached, past the cached run, last
        bad[at] = -7
        with pytest.raises(InputError, match=r"got values in \[-7, "):
            s.lookup(bad)
        bad[at] = tokens[at]
    wide = tokens.astype(np.uint64)
    wide[3000 * TPP] = 1 << 40
    with pytest.raises(InputError, match=str(1 << 40)):
        s.lookup(wide)
    assert s.lookup(tokens).cached_pages == 600   # the connection goes on
    out = np.zeros((600, PB), np.uint8)
    assert s.get(tokens, out).pages == 600 and np.array_equal(out, data)


def test_a_long_prompt(opened: Opened, tmp_path: Path) -> None:
    """Past protocol.INLINE_TOKENS the connected client passes tokens through shared memory."""
    s = opened(make_config(tmp_path / "s", 8, 16))
    tokens = np.random.default_rng(3).integers(0, 50000, 100_000, dtype=np.int64)
    data = page_data(21, 12)
    assert s.put(tokens[:12 * TPP], data).stored == 12
    r = s.lookup(tokens)
    assert (r.cached_pages, r.total_pages) == (12, 100_000 // TPP)
    out = np.zeros((20, PB), np.uint8)
    assert s.get(tokens, out).pages == 12 and np.array_equal(out[:12], data)
    assert s.pin(tokens) == 12 and s.unpin(tokens) == 12
    assert s.prefetch(tokens).result(timeout=30) == 8
    shifted = tokens.copy()
    shifted[5000] += 1                 # a change past the cached pages changes nothing before it
    assert s.lookup(shifted).cached_pages == 12
    shifted[100] += 1
    assert s.lookup(shifted).cached_pages == 100 // TPP
