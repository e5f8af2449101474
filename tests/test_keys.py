"""Tests of tierkv.keys: the key chain (compiled and Python), validation, and KeySet.

The compiled module is held to the pure-Python chain, which is written directly on
the ``xxhash`` package; tests of native-only behaviour skip where it is not built.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import types
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import tierkv
from tierkv import keys
from tierkv.errors import InputError
from tierkv.keys import (KEY_BYTES, PageKeySet, _chain_keys_py, as_token_array, chain_keys, namespace_digest,
                         page_keys)
from tierkv.layout import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, tokens_per_page=16)
NS = bytes(range(16))
REPO = Path(tierkv.__file__).resolve().parent.parent


def _native() -> types.ModuleType:
    return pytest.importorskip("tierkv._native", reason="tierkv._native is not built")


def _tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1 << 32, n, dtype=np.uint32)


# ---------------------------------------------------------------- the chain

def test_chain_known_answer() -> None:
    """Pins the key scheme: a change here invalidates every page already stored."""
    blob = _chain_keys_py(np.arange(48, dtype="<u4"), 16, NS)
    assert blob.hex() == ("e45996ed13e41c93236ee9e8e0a457a0cfa6eed33363b9af7edf8f89211f07e4"
                          "0a2a4f9aaad612c7e42caf538a9a3275")
    first = xxhash.xxh3_128_digest(NS + np.arange(16, dtype="<u4").tobytes())
    assert blob[:KEY_BYTES] == first
    assert chain_keys(np.arange(48, dtype="<u4"), 16, NS) == blob


@settings(max_examples=200, deadline=None)
@given(data=st.lists(st.integers(0, (1 << 32) - 1), max_size=400),
       tokens_per_page=st.sampled_from([1, 3, 7, 8, 16, 17, 28, 29, 32, 33, 64, 100]),
       namespace=st.binary(min_size=16, max_size=16))
def test_native_chain_matches_python(data: list[int], tokens_per_page: int, namespace: bytes) -> None:
    native = _native()
    tokens = np.asarray(data, dtype="<u4")
    n_pages = tokens.size // tokens_per_page
    expected = _chain_keys_py(tokens, tokens_per_page, namespace)
    assert native.chain_xxh3_128(namespace, tokens, tokens_per_page, n_pages) == expected
    # The same tokens as big-endian uint32 or as raw little-endian bytes hash the same.
    assert native.chain_xxh3_128(namespace, tokens.astype(">u4"), tokens_per_page, n_pages) == expected
    assert native.chain_xxh3_128(namespace, tokens.tobytes(), tokens_per_page, n_pages) == expected
    # ... and as 8-byte ids in the host's order (numpy's int64 and uint64), narrowed as hashed.
    assert native.chain_xxh3_128(namespace, tokens.astype(np.int64), tokens_per_page, n_pages) == expected
    assert native.chain_xxh3_128(namespace, tokens.astype(np.uint64), tokens_per_page, n_pages) == expected


def test_native_chain_matches_python_for_every_page_size_past_a_block() -> None:
    """Every page size from 1 to 100 tokens (the split chain runs for 8 to 28), over more
    pages than a block of the split chain (32), as uint32 and as int64 ids."""
    native = _native()
    for tokens_per_page in range(1, 101):
        tokens = _tokens(70 * tokens_per_page + tokens_per_page // 2, seed=tokens_per_page)
        expected = _chain_keys_py(tokens, tokens_per_page, NS)
        assert native.chain_xxh3_128(NS, tokens, tokens_per_page, 70) == expected, tokens_per_page
        assert native.chain_xxh3_128(NS, tokens.astype(np.int64), tokens_per_page, 70) == expected, tokens_per_page


def test_native_narrow_ids_takes_only_what_it_can_read() -> None:
    native = _native()
    ids = np.arange(10, dtype=np.int64) * 3
    out = np.zeros(10, np.uint32)
    assert native.narrow_ids(ids, out) is True and np.array_equal(out, ids)
    assert native.narrow_ids(np.array([1, -1] * 5, np.int64), out) is False
    wrong_order = ">i8" if sys.byteorder == "little" else "<i8"
    for src, dst, error in ((np.zeros(1, wrong_order), np.zeros(1, np.uint32), TypeError),
                            (np.zeros(1, np.float64), np.zeros(1, np.uint32), TypeError),
                            (ids, np.zeros(10, np.int32), ValueError),
                            (ids, np.zeros(9, np.uint32), ValueError)):
        with pytest.raises(error):
            native.narrow_ids(src, dst)
    read_only = np.zeros(10, np.uint32)
    read_only.flags.writeable = False
    with pytest.raises((ValueError, BufferError)):
        native.narrow_ids(ids, read_only)


def test_native_narrowing_is_the_same_at_every_vector_level() -> None:
    """narrow_ids and the chain of int64 ids at each level the CPU has (AVX-512, AVX2,
    the portable loop): the same uint32s and keys, and an id out of range found wherever
    it lies (a vector's first or last lane, the tail after the last whole vector), at
    unaligned addresses too."""
    native = _native()
    best = native.set_simd(2)
    rng = np.random.default_rng(5)
    try:
        for level in range(best, -1, -1):
            assert native.set_simd(level) == level
            for n in (*range(0, 40), 1023, 1024, 1025, 4096 + 13):
                raw = np.zeros(n * 8 + 8, np.uint8)
                ids = raw[4:4 + n * 8].view(np.int64) if level % 2 else raw[8:].view(np.int64)   # unaligned or not
                ids[:] = rng.integers(0, 1 << 32, n)
                out = np.zeros(n, np.uint32)
                assert native.narrow_ids(ids, out) is True and np.array_equal(out, ids.astype(np.uint32)), (level, n)
                pages = n // 16
                expected = _chain_keys_py(ids.astype(np.uint32), 16, NS)
                assert native.chain_xxh3_128(NS, ids, 16, pages) == expected, (level, n)
                for at in {0, n // 2, n - 1} if n else set():
                    for bad in (1 << 32, -1, 1 << 62):
                        keep = int(ids[at])
                        ids[at] = bad
                        assert native.narrow_ids(ids, out) is False, (level, n, at, bad)
                        with pytest.raises(OverflowError):
                            native.chain_xxh3_128(NS, ids, 16, pages)
                        ids[at] = keep
    finally:
        native.set_simd(best)
    with pytest.raises(ValueError, match="0 .portable., 1 .AVX2. or 2"):
        native.set_simd(3)


def test_native_chain_can_stop_early() -> None:
    native = _native()
    tokens = _tokens(100)
    assert native.chain_xxh3_128(NS, tokens, 16, 2) == _chain_keys_py(tokens[:32], 16, NS)
    assert native.chain_xxh3_128(NS, tokens, 16, 0) == b""


@pytest.mark.parametrize("args, error, match", [
    ((NS[:15], np.zeros(16, np.uint32), 16, 1), ValueError, "namespace must be 16 bytes, got 15"),
    ((NS, np.zeros(16, np.uint32), 0, 1), ValueError, "tokens_per_page"),
    ((NS, np.zeros(16, np.uint32), 16, -1), ValueError, "n_pages must be >= 0"),
    ((NS, np.zeros(16, np.int64), (1 << 61) - 8, 1), ValueError, "1 pages of"),
    ((NS, np.zeros(31, np.uint32), 16, 2), ValueError, "2 pages of 16 tokens need 32 tokens, the buffer holds 31"),
    ((NS, np.zeros(16, np.int32), 16, 1), TypeError, "format 'i'"),
    ((NS, np.zeros(16, ">i8" if sys.byteorder == "little" else "<i8"), 16, 1), TypeError, "host's order"),
    ((NS, np.zeros(16, np.int16), 16, 1), TypeError, "8-byte integers"),
    ((NS, np.array([1] * 15 + [-1], np.int64), 16, 1), OverflowError, "outside"),
    ((NS, np.array([1] * 16 + [1 << 32], np.uint64), 16, 1), OverflowError, "outside"),   # the partial page too
    ((NS, np.array([1] * 32 + [-1], np.int64), 16, 1), OverflowError, "outside"),   # ids past n_pages too
    ((NS, list(range(16)), 16, 1), TypeError, "got list"),
    (("x" * 16, np.zeros(16, np.uint32), 16, 1), TypeError, "bytes-like"),
])
def test_native_chain_rejects_bad_arguments(args: tuple[object, ...], error: type[Exception], match: str) -> None:
    native = _native()
    with pytest.raises(error, match=match):
        native.chain_xxh3_128(*args)


def test_native_chain_rejects_non_contiguous_tokens() -> None:
    native = _native()
    with pytest.raises((ValueError, BufferError)):
        native.chain_xxh3_128(NS, _tokens(64)[::2], 16, 1)


def test_chain_is_thread_safe() -> None:
    """The chain drops the GIL: concurrent calls must not disturb each other."""
    prompts = [_tokens(4096, seed) for seed in range(8)]
    expected = [_chain_keys_py(t, 16, NS) for t in prompts]
    got: list[bytes] = [b""] * len(prompts)

    def work(i: int) -> None:
        for _ in range(20):
            got[i] = chain_keys(prompts[i], 16, NS)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == expected


_CHILD = """
import sys
import numpy as np
import tierkv.keys as keys
from tierkv.layout import KVLayout
if sys.argv[1] == "python":
    keys._native = None
layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, tokens_per_page=16)
tokens = np.random.default_rng(7).integers(0, 1 << 32, 1000, dtype=np.uint32)
ns = keys.namespace_digest("m", layout, "tenant-a")
print(b"".join(keys.page_keys(tokens, layout, ns)).hex())
"""


@pytest.mark.parametrize("mode", ["default", "python"])
@pytest.mark.parametrize("hash_seed", ["0", "4242"])
def test_keys_identical_across_processes(mode: str, hash_seed: str) -> None:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed,
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.run([sys.executable, "-c", _CHILD, mode], env=env, capture_output=True,
                           text=True, check=True, timeout=120)
    tokens = np.random.default_rng(7).integers(0, 1 << 32, 1000, dtype=np.uint32)
    here = b"".join(page_keys(tokens, LAYOUT, namespace_digest("m", LAYOUT, "tenant-a")))
    assert child.stdout.strip() == here.hex()
    assert len(here) == (1000 // 16) * KEY_BYTES


def test_namespaces_separate_tenants_models_and_layouts() -> None:
    tokens = _tokens(64)
    other_layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=128, tokens_per_page=16)
    namespaces = [
        namespace_digest("m", LAYOUT),
        namespace_digest("m", LAYOUT, "tenant-a"),
        namespace_digest("m", LAYOUT, b"tenant-b"),
        namespace_digest("m2", LAYOUT),
        namespace_digest("m", other_layout),
        namespace_digest("m", KVLayout(num_layers=LAYOUT.num_layers, num_kv_heads=LAYOUT.num_kv_heads,
                                       head_dim=LAYOUT.head_dim, dtype=LAYOUT.dtype,
                                       tokens_per_page=LAYOUT.tokens_per_page, page_order="vllm_cpu")),
    ]
    assert namespace_digest("m", LAYOUT, "tenant-a") == namespace_digest("m", LAYOUT, b"tenant-a")
    all_keys = [page_keys(tokens, LAYOUT, ns) for ns in namespaces]
    flat = [k for ks in all_keys for k in ks]
    assert len(set(flat)) == len(flat) == 4 * len(namespaces)


def test_partial_last_page_has_no_key() -> None:
    tokens = _tokens(40)
    ks = page_keys(tokens, LAYOUT, NS)
    assert len(ks) == 2
    assert ks == page_keys(tokens[:32], LAYOUT, NS)  # a page's key depends only on its prefix
    assert page_keys(tokens[:15], LAYOUT, NS) == []
    assert page_keys([], LAYOUT, NS) == []


@pytest.mark.parametrize("bad, match", [
    ([1, -1, 2], r"\[-1, 2\]"),
    ([0, 1 << 32], "4294967296"),
    (np.array([1.0, 2.0]), "integers"),
    (np.zeros((2, 16), dtype=np.uint32), "one-dimensional"),
    ([[1, 2], [3, 4]], "one-dimensional"),
    ([1 << 70], "integers"),
    (torch.tensor([1.5, 2.5]), "integers"),
    (np.array([3, -1], np.int64), r"\[-1, 3\]"),               # each width's own check
    (np.array([3, 1 << 32], np.int64), "4294967296"),
    (np.array([1 << 63], np.uint64), "9223372036854775808"),
    (np.array([3, -1], ">i8"), r"\[-1, 3\]"),
    (np.array([3, 1 << 32], ">u8"), "4294967296"),
    (np.array([3, -1], np.int32), r"\[-1, 3\]"),
    (np.array([3, -1], np.int8), r"\[-1, 3\]"),
    (torch.tensor([3, -1]), r"\[-1, 3\]"),
])
def test_bad_tokens_raise_input_error(bad: object, match: str) -> None:
    with pytest.raises(InputError, match=match):
        page_keys(bad, LAYOUT, NS)  # type: ignore[arg-type]


def test_bad_namespace_raises_input_error() -> None:
    with pytest.raises(InputError, match="16 bytes, got 3"):
        chain_keys(_tokens(32), 16, b"abc")


def test_list_tensor_and_array_inputs_agree() -> None:
    tokens = _tokens(100) >> 1  # below 2**31, so that int32 tensors hold them too
    expected = page_keys(tokens, LAYOUT, NS)
    assert page_keys(tokens.tolist(), LAYOUT, NS) == expected
    assert page_keys(torch.from_numpy(tokens.astype(np.int64)), LAYOUT, NS) == expected
    assert page_keys(torch.from_numpy(tokens.astype(np.int32)), LAYOUT, NS) == expected
    assert page_keys(tokens.astype(np.int64), LAYOUT, NS) == expected
    assert page_keys(tokens.astype(">u4"), LAYOUT, NS) == expected


def test_a_long_prompt_is_one_native_call(monkeypatch: pytest.MonkeyPatch) -> None:
    native = _native()
    calls: list[int] = []

    def counting(namespace: bytes, tokens: np.ndarray, tokens_per_page: int, n_pages: int) -> bytes:
        calls.append(n_pages)
        return native.chain_xxh3_128(namespace, tokens, tokens_per_page, n_pages)  # type: ignore[no-any-return]

    monkeypatch.setattr(keys, "_native", types.SimpleNamespace(chain_xxh3_128=counting))
    ks = page_keys(_tokens(131072), LAYOUT, NS)
    assert calls == [8192]
    assert len(ks) == 8192 and len(set(ks)) == 8192


@pytest.mark.parametrize("tokens_per_page", [16, 5, 32])
def test_the_stretches_and_the_one_pass_paths_make_the_same_keys(tokens_per_page: int) -> None:
    """chain_token_keys (ids narrowed as hashed), token_ids with chain_stretches (a lookup's
    stretches, each chained from the last key of the one before) and narrow_into (a
    client's ids into its token segment) give what as_token_array and chain_keys give."""
    ids = _tokens(64 * 16 * 9 + 37, seed=3) >> 1
    expected = _chain_keys_py(ids, tokens_per_page, NS)
    for arr in (ids, ids.astype(np.int64), ids.astype(np.uint64), ids.tolist(), ids.astype(">u4")):
        assert keys.chain_token_keys(arr, tokens_per_page, NS) == expected  # type: ignore[arg-type]
        got = list(keys.chain_stretches(keys.token_ids(arr), tokens_per_page, NS))   # type: ignore[arg-type]
        assert b"".join(got) == expected
        sizes, left, span = [], ids.size // tokens_per_page, 64
        while left > 0:
            sizes.append(min(left, span))
            left, span = left - span, span * 8
        assert [len(b) // KEY_BYTES for b in got] == sizes
    assert list(keys.chain_stretches(keys.token_ids([1, 2]), tokens_per_page, NS)) == [b""]   # always one
    out = np.zeros(ids.size, np.uint32)
    keys.narrow_into(ids.astype(np.int64), out)
    assert np.array_equal(out, ids)


@pytest.mark.parametrize("bad", [np.array([5] * 3000 + [-1], np.int64), np.array([5] * 3000 + [1 << 32], np.int64),
                                 np.array([1 << 40] + [5] * 3000, np.uint64)])
def test_bad_ids_in_long_prompts_are_input_errors_on_every_path(bad: np.ndarray) -> None:
    """The one-pass paths check every id, past the last full page and past a lookup's
    first stretch too, and say what as_token_array says."""
    _native()
    lo, hi = int(bad.min()), int(bad.max())
    match = f"got values in \\[{lo}, {hi}\\]"
    with pytest.raises(InputError, match=match):
        keys.chain_token_keys(bad, 16, NS)
    with pytest.raises(InputError, match=match):
        keys.token_ids(bad)
    with pytest.raises(InputError, match=match):
        keys.narrow_into(bad, np.zeros(bad.size, np.uint32))


def test_ids_changed_after_their_check_are_input_errors_too() -> None:
    """A caller's array written while a lookup reads it (another thread) gives an
    InputError, never the C chain's OverflowError."""
    _native()
    ids = np.arange(64 * 16 * 2, dtype=np.int64)
    checked = keys.token_ids(ids)
    ids[-1] = -1
    with pytest.raises(InputError, match=r"\[-1, "):
        list(keys.chain_stretches(checked, 16, NS))
    ids[-1] = 5
    stretches = keys.chain_stretches(keys.token_ids(ids), 16, NS)
    next(stretches)
    ids[-1] = 1 << 40
    with pytest.raises(InputError, match="1099511627776"):
        next(stretches)


def test_checksum64_matches_xxhash() -> None:
    native = _native()
    rng = np.random.default_rng(3)
    # Past 240 bytes the long-input loop runs (AVX-512 or AVX2 where the CPU has them):
    # its stripes (64 bytes), blocks (1,024) and tails, and a buffer off a vector boundary.
    for size in (0, 1, 17, 240, 241, 1023, 1024, 1025, 4096, 16383, 16384, 36904, 1 << 20):
        data = rng.integers(0, 256, size + 1, dtype=np.uint8)[1:]
        assert native.checksum64(data) == xxhash.xxh3_64_intdigest(data.tobytes())
        assert native.checksum64(data.tobytes()) == xxhash.xxh3_64_intdigest(data.tobytes())
    with pytest.raises(TypeError, match="bytes-like"):
        native.checksum64("text")


# ---------------------------------------------------------------- KeySet

@pytest.fixture(scope="module", params=["native", "python"])  # a factory: no state to reset
def make_keyset(request: pytest.FixtureRequest) -> Callable[[], PageKeySet]:
    if request.param == "native":
        return _native().KeySet  # type: ignore[no-any-return]
    return keys.KeySet


_RNG = random.Random(11)
# Random keys, the all-zero key (the native table's free-slot marker) and keys whose two
# halves are equal, which all hash to one home slot: long probe runs to delete from.
UNIVERSE = ([bytes(16), b"\xff" * 16] + [bytes([i]) * 8 * 2 for i in range(1, 7)]
            + [_RNG.randbytes(16) for _ in range(12)])

_OPS = st.tuples(st.sampled_from(["add"] * 4 + ["discard"] * 3 + ["contains"] * 2 + ["prefix"] * 2 + ["clear"]),
                 st.integers(0, len(UNIVERSE) - 1),
                 st.lists(st.integers(0, len(UNIVERSE) - 1), max_size=10),
                 st.integers(0, 10))


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(_OPS, min_size=10, max_size=150))
def test_keyset_matches_a_python_dict(make_keyset: Callable[[], PageKeySet],
                                      ops: list[tuple[str, int, list[int], int]]) -> None:
    ks, model = make_keyset(), {}
    for op, index, blob_indices, start in ops:
        key = UNIVERSE[index]
        if op == "add":
            value = (index * 37 + start) % 256  # re-adding a present key sets a new value
            ks.add(key, value)
            model[key] = value
        elif op == "discard":
            ks.discard(key)
            model.pop(key, None)
        elif op == "clear":
            ks.clear()
            model.clear()
        elif op == "contains":
            assert (key in ks) == (key in model)
            assert ks.get(key) == model.get(key)
        else:
            blob_keys = [UNIVERSE[i] for i in blob_indices]
            start = min(start, len(blob_keys))
            expected = 0
            while start + expected < len(blob_keys) and blob_keys[start + expected] in model:
                expected += 1
            assert ks.prefix_len(b"".join(blob_keys), start) == expected
            lead = []
            for k in blob_keys:
                if k not in model:
                    break
                lead.append(model[k])
            assert ks.prefix_values(b"".join(blob_keys)) == bytes(lead)
        assert len(ks) == len(model)
    assert all(ks.get(key) == model.get(key) for key in UNIVERSE)


def test_keyset_grows_past_many_thousand_keys(make_keyset: Callable[[], PageKeySet]) -> None:
    ks = make_keyset()
    blob = chain_keys(_tokens(60_000 * 4), 4, NS)
    all_keys = [blob[i:i + KEY_BYTES] for i in range(0, len(blob), KEY_BYTES)]
    for key in all_keys:
        ks.add(key)
    ks.add(all_keys[0])
    assert len(ks) == 60_000
    assert ks.prefix_len(blob) == 60_000
    for key in all_keys[::2]:
        ks.discard(key)
    assert len(ks) == 30_000
    assert all((key in ks) == (i % 2 == 1) for i, key in enumerate(all_keys))
    assert ks.prefix_len(blob, 1) == 1
    ks.clear()
    assert len(ks) == 0 and ks.prefix_len(blob) == 0
    ks.add(all_keys[5])
    assert all_keys[5] in ks and len(ks) == 1


def test_keyset_prefix_len_start_and_buffers(make_keyset: Callable[[], PageKeySet]) -> None:
    ks = make_keyset()
    blob = chain_keys(_tokens(160), 16, NS)
    for i in (0, 1, 2, 4, 5):
        ks.add(blob[16 * i:16 * (i + 1)])
    assert ks.prefix_len(blob) == 3
    assert ks.prefix_len(blob, 3) == 0
    assert ks.prefix_len(blob, 4) == 2
    assert ks.prefix_len(blob, 10) == 0
    assert ks.prefix_len(bytearray(blob)) == 3
    assert ks.prefix_len(memoryview(blob)[16:]) == 2
    assert ks.prefix_len(b"") == 0
    assert bytearray(blob[:16]) in ks and memoryview(blob[16:32]) in ks


@pytest.mark.parametrize("call", ["add", "discard", "contains"])
def test_keyset_rejects_bad_keys(make_keyset: Callable[[], PageKeySet], call: str) -> None:
    ks = make_keyset()
    op: Callable[[object], object] = (ks.__contains__ if call == "contains"  # type: ignore[assignment]
                                      else getattr(ks, call))
    with pytest.raises(ValueError, match="16 bytes, got 15"):
        op(b"x" * 15)
    with pytest.raises(ValueError, match="16 bytes, got 32"):
        op(b"x" * 32)
    with pytest.raises(TypeError, match="bytes"):
        op(12345)
    with pytest.raises(TypeError, match="bytes"):
        op("a" * 16)
    assert len(ks) == 0


def test_keyset_prefix_len_rejects_bad_blobs(make_keyset: Callable[[], PageKeySet]) -> None:
    ks = make_keyset()
    with pytest.raises(ValueError, match="whole 16-byte keys, got 17 bytes"):
        ks.prefix_len(b"x" * 17)
    with pytest.raises(ValueError, match=r"start must lie in \[0, 2\], got 3"):
        ks.prefix_len(b"x" * 32, 3)
    with pytest.raises(ValueError, match=r"start must lie in \[0, 2\], got -1"):
        ks.prefix_len(b"x" * 32, -1)


def test_new_keyset_prefers_native(monkeypatch: pytest.MonkeyPatch) -> None:
    if keys.native_available():
        assert type(keys.new_keyset()).__module__ == "tierkv._native"
    monkeypatch.setattr(keys, "_native", None)
    assert isinstance(keys.new_keyset(), keys.KeySet)
    assert chain_keys(np.arange(48, dtype="<u4"), 16, NS) == _chain_keys_py(np.arange(48, dtype="<u4"), 16, NS)


@pytest.mark.parametrize("tenant", ["\udc80", bytearray(b"t"), ["t"], 7])
def test_bad_tenants_are_input_errors_in_the_store_too(tmp_path: Path, tenant: object) -> None:
    from tests.conftest import make_config
    from tierkv.store.api import Store

    with Store.open(make_config(tmp_path / "s", 4, 0)) as s:
        with pytest.raises(InputError, match="tenant salt"):
            s.lookup(np.arange(32, dtype=np.int64), tenant=tenant)  # type: ignore[arg-type]


def test_tokens_on_the_meta_device_are_refused_by_name() -> None:
    """Issue 28 item 7: a meta tensor raised NotImplementedError from torch."""
    with pytest.raises(InputError, match="meta device, which holds no values"):
        as_token_array(torch.arange(64, device="meta"))
    assert as_token_array(torch.arange(4)).tolist() == [0, 1, 2, 3]
