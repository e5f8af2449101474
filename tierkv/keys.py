"""Deterministic page keys: prefix-chained xxh3-128 salted per model, layout and tenant.

The key of page ``i`` is ``xxh3_128(key[i-1] || tokens[i*P:(i+1)*P] as uint32 LE)``,
where ``key[-1]`` is the namespace digest of (model id, layout, tenant salt) and
``P`` is the layout's tokens per page. Keys are the canonical (big-endian) 16-byte
digests, identical across processes, restarts and machines; Python's ``hash()`` is
never involved. Only full pages get keys.

The chain runs in C (``tierkv._native``) when the extension is built, otherwise in a
Python loop over the ``xxhash`` package; both give the same bytes (tested). Called by
the API for every lookup, put and get. :func:`new_keyset` gives the index's set of
keys (compiled, or a Python fallback with the same contract).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator, Sequence
from typing import NewType, Protocol, TypeGuard

import numpy as np

import xxhash

from tierkv.errors import InputError
from tierkv.layout import KVLayout

try:  # the compiled chain; optional so that a machine without a compiler still works
    from tierkv import _native  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - exercised where the extension is absent
    _native = None

PageKey = NewType("PageKey", bytes)
KEY_BYTES = 16
_MAX_TOKEN = (1 << 32) - 1


class _TensorLike(Protocol):
    def numpy(self) -> np.ndarray: ...


Tokens = Sequence[int] | np.ndarray | _TensorLike
KeyBytes = bytes | bytearray | memoryview


def native_available() -> bool:
    """Whether the compiled key chain is in use."""
    return _native is not None


def namespace_digest(model_id: str, layout: KVLayout, tenant: str | bytes = b"") -> bytes:
    """The 16-byte chain seed of one (model, layout, tenant) namespace.

    Pages of different tenants never share a key, on any tier, because the seed differs.
    """
    if not isinstance(model_id, str) or not model_id:
        raise InputError(f"model_id must be a non-empty string, got {model_id!r}")
    tenant = tenant_salt(tenant)
    header = json.dumps({"v": 1, "model": model_id, "layout": layout.fingerprint().decode()},
                        sort_keys=True).encode()
    # Length-prefix each part so that no (model, tenant) pair can collide with another.
    material = len(header).to_bytes(8, "little") + header + len(tenant).to_bytes(8, "little") + tenant
    return xxhash.xxh3_128_digest(b"tierkv-namespace\0" + material)


def tenant_salt(tenant: object) -> bytes:
    """A tenant as the bytes that salt its namespace (a str is UTF-8); InputError otherwise."""
    if isinstance(tenant, str):
        try:
            return tenant.encode()
        except UnicodeEncodeError as exc:  # a lone surrogate cannot be UTF-8
            raise InputError(f"tenant salt {tenant!r} is not encodable as UTF-8: {exc.reason}") from None
    if not isinstance(tenant, bytes):
        raise InputError(f"tenant salt must be str or bytes, got {type(tenant).__name__}")
    return tenant


def as_token_array(tokens: Tokens) -> np.ndarray:
    """Tokens as a contiguous little-endian uint32 array; raises InputError otherwise."""
    if hasattr(tokens, "numpy") and not isinstance(tokens, np.ndarray):
        tensor = tokens
        device = str(getattr(tensor, "device", "cpu"))
        if device == "meta":
            raise InputError("tokens are a tensor on the meta device, which holds no values; pass the token ids")
        if device != "cpu":
            tensor = tensor.cpu()  # type: ignore[attr-defined, union-attr]
        try:
            arr = np.asarray(tensor.numpy())
        except TypeError as exc:   # a dtype numpy lacks (bfloat16): not token ids
            raise InputError(f"tokens must be integers, got a tensor numpy cannot hold: {exc}") from None
    else:
        try:
            arr = np.asarray(tokens)
        except (ValueError, TypeError) as exc:   # a ragged list, a list of objects
            raise InputError(f"tokens must be a one-dimensional sequence of integers: {exc}") from None
    if arr.ndim != 1:
        raise InputError(f"tokens must be one-dimensional, got shape {tuple(arr.shape)}")
    if arr.size == 0:
        return np.zeros(0, dtype="<u4")
    kind, size = arr.dtype.kind, arr.dtype.itemsize
    if kind not in "iu":
        raise InputError(f"tokens must be integers, got dtype {arr.dtype}")
    # One pass where one suffices: unsigned ids of 4 bytes or fewer are all valid; signed
    # ones of 4 bytes or fewer need only a minimum; 8-byte ones are checked as unsigned
    # (a negative id reads as one past 2**63, so past the largest id either way).
    if kind == "u" and size <= 4:
        bad = False
    elif size <= 4:
        bad = int(arr.min()) < 0
    elif arr.dtype.isnative:
        bad = int(arr.view(np.uint64).max()) > _MAX_TOKEN
    else:
        bad = int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN
    if bad:
        lo, hi = int(arr.min()), int(arr.max())
        raise InputError(f"token ids must lie in [0, {_MAX_TOKEN}], got values in [{lo}, {hi}]")
    return np.ascontiguousarray(arr, dtype="<u4")


def chain_keys(tokens: np.ndarray, tokens_per_page: int, namespace: bytes) -> bytes:
    """Keys of every full page of ``tokens`` (from :func:`as_token_array`), concatenated.

    Returns ``n_full_pages * 16`` bytes; key ``i`` is ``result[16*i:16*(i+1)]``.
    """
    if len(namespace) != KEY_BYTES:
        raise InputError(f"namespace digest must be {KEY_BYTES} bytes, got {len(namespace)}")
    if tokens_per_page <= 0:
        raise InputError(f"tokens_per_page must be positive, got {tokens_per_page}")
    if tokens.dtype != np.dtype("<u4") or not tokens.flags.c_contiguous:
        raise InputError(f"chain_keys takes contiguous little-endian uint32 tokens (see as_token_array), "
                         f"got {tokens.dtype}")
    n_pages = tokens.size // tokens_per_page
    if n_pages == 0:
        return b""
    if _native is not None:
        return bytes(_native.chain_xxh3_128(namespace, tokens, tokens_per_page, n_pages))
    return _chain_keys_py(tokens, tokens_per_page, namespace)


def chain_token_keys(tokens: Tokens, tokens_per_page: int, namespace: bytes) -> bytes:
    """``chain_keys(as_token_array(tokens), tokens_per_page, namespace)``, with the same
    errors. Token ids in a numpy int64 or uint64 array (what tokenizers and
    engines hold) are checked and narrowed to uint32 in C while they are hashed: one pass
    instead of a range check, a converted copy, then the hash (a third of a long prompt's
    lookup, measured for issue 21)."""
    if wide_ids(tokens) and len(namespace) == KEY_BYTES and tokens_per_page > 0:
        assert _native is not None
        try:
            return bytes(_native.chain_xxh3_128(namespace, tokens, tokens_per_page, tokens.size // tokens_per_page))
        except OverflowError:
            raise range_error(tokens) from None
    return chain_keys(as_token_array(tokens), tokens_per_page, namespace)


def token_ids(tokens: Tokens) -> np.ndarray:
    """The ids of ``tokens``, every one checked as :func:`as_token_array` checks them, as
    an array :func:`chain_stretches` reads: a numpy int64 or uint64 array in the host's
    order as it is where the C chain is built (it narrows the ids as it hashes them),
    anything else as :func:`as_token_array` makes it."""
    if wide_ids(tokens):
        if tokens.size == 0 or int(tokens.view(np.uint64).max()) <= _MAX_TOKEN:   # a negative id reads as above
            return tokens
    return as_token_array(tokens)


def narrow_into(ids: np.ndarray, out: np.ndarray) -> None:
    """Check the 8-byte ids of ``ids`` (:func:`wide_ids`) and write them into ``out``
    (uint32, as many) in one pass; InputError, as :func:`as_token_array` raises it, for an
    id outside the range."""
    if not wide_ids(ids):
        raise InputError(f"narrow_into takes a contiguous 1-D int64 or uint64 array, got {type(ids).__name__}")
    assert _native is not None
    if not _native.narrow_ids(ids, out):
        raise range_error(ids)


def range_error(ids: np.ndarray) -> InputError:
    """The error for 8-byte ids the C code found outside the range: as_token_array's, or
    (the array changed since it was read there) one that says so."""
    try:
        as_token_array(ids)
    except InputError as exc:
        return exc
    return InputError(f"a token id lay outside [0, {_MAX_TOKEN}] while it was read, and not since: "
                      "the array changed during the call")


def wide_ids(tokens: Tokens) -> TypeGuard[np.ndarray]:
    """Whether the C chain reads ``tokens`` as they are: a contiguous 1-D numpy array of
    int64 or uint64 in the host's order (the ids are narrowed to uint32 as they are hashed)."""
    return (_native is not None and type(tokens) is np.ndarray and tokens.ndim == 1 and tokens.dtype.itemsize == 8
            and tokens.dtype.kind in "iu" and tokens.dtype.isnative and tokens.flags.c_contiguous)


def stretch_ends(total_pages: int, first: int = 64, growth: int = 8) -> Iterator[int]:
    """Where the stretches of :func:`chain_stretches` end, in pages: ``first``, then
    ``growth`` times as many as the last each time, the last at ``total_pages`` (one, at
    0, without a full page)."""
    end, span = 0, first
    while True:
        end = min(total_pages, end + span)
        yield end
        if end == total_pages:
            return
        span *= growth


def chain_stretches(ids: np.ndarray, tokens_per_page: int, namespace: bytes,
                    first: int = 64, growth: int = 8, ready: Callable[[int], None] | None = None) -> Iterator[bytes]:
    """The keys of the full pages of ``ids`` (from :func:`token_ids`) as :func:`chain_keys`
    makes them, a stretch at a time: ``first`` pages, then ``growth`` times as many as the
    last each time, at least one stretch (empty without a full page). A caller that stops
    at the first page it does not hold hashes no further: a lookup then costs what its
    cached prefix costs, not what its prompt does (issue 21). ``ready(n)``, where given,
    is called before a stretch is hashed and returns once the first ``n`` ids are in place
    (ids another process is still writing: a node service's lookups)."""
    start, parent = 0, namespace
    for end in stretch_ends(ids.size // tokens_per_page, first, growth):
        if ready is not None:
            ready(end * tokens_per_page)
        if _native is not None:
            try:
                blob = bytes(_native.chain_xxh3_128(parent, ids[start * tokens_per_page:end * tokens_per_page],
                                                    tokens_per_page, end - start))
            except OverflowError:   # checked by token_ids: the caller's array changed since
                raise range_error(ids) from None
        else:
            blob = chain_keys(ids[start * tokens_per_page:end * tokens_per_page], tokens_per_page, parent)
        yield blob
        start, parent = end, blob[-KEY_BYTES:] if blob else parent


def _chain_keys_py(tokens: np.ndarray, tokens_per_page: int, namespace: bytes) -> bytes:
    """The pure-Python chain: the fallback, and the reference the tests hold the C chain to."""
    n_pages = tokens.size // tokens_per_page
    raw = tokens[: n_pages * tokens_per_page].tobytes()
    step = tokens_per_page * 4
    digest = xxhash.xxh3_128_digest
    prev = namespace
    out = bytearray(n_pages * KEY_BYTES)
    for i in range(n_pages):
        prev = digest(prev + raw[i * step:(i + 1) * step])
        out[i * KEY_BYTES:(i + 1) * KEY_BYTES] = prev
    return bytes(out)


def derived_seed(previous: bytes) -> bytes:
    """The chain seed of *derived* pages (moved by a splice, :mod:`tierkv.splice`) that
    follow the page whose key is ``previous`` (or the namespace digest, at a prompt's
    start): derived page ``j`` of a prompt is keyed by continuing the chain from this
    seed, so it names the whole prompt's tokens and the exact page it follows, and can
    never be taken for an exact page (that would take a different 16-byte input than
    any exact key's: no exact chain step hashes 33 bytes)."""
    if len(previous) != KEY_BYTES:
        raise InputError(f"a derived chain follows a {KEY_BYTES}-byte key, got {len(previous)} bytes")
    return xxhash.xxh3_128_digest(b"tierkv-derived\0v1" + previous)


def lossy_keys(blob: bytes, budget: float) -> bytes:
    """The keys of *lossy* pages (:mod:`tierkv.lossy`) coded at ``budget`` bits an element,
    from the exact keys ``blob`` of the same pages: each one hashed with the budget, so it
    names the same prefix, model and tenant, no exact or derived key (nor another budget's)
    can equal it, and a page's lossy key follows from its exact key alone (what a tier that
    converts pages as they are demoted needs)."""
    if len(blob) % KEY_BYTES:
        raise InputError(f"lossy keys come from {KEY_BYTES}-byte keys, got {len(blob)} bytes")
    tag = b"tierkv-lossy\0v1" + struct.pack("<d", float(budget))
    digest = xxhash.xxh3_128_digest
    return b"".join(digest(tag + blob[i:i + KEY_BYTES]) for i in range(0, len(blob), KEY_BYTES))


def split_keys(blob: bytes) -> list[PageKey]:
    """The 16-byte keys of a :func:`chain_keys` result, in page order (as 16-byte void
    items: numpy makes the bytes objects in C, 15x faster than slicing 256 keys here)."""
    nbytes = memoryview(blob).nbytes
    if nbytes % KEY_BYTES:
        raise InputError(f"a key blob is a whole number of {KEY_BYTES}-byte keys, got {nbytes} bytes")
    keys: list[PageKey] = np.frombuffer(blob, f"V{KEY_BYTES}").tolist()
    return keys


def take_keys(blob: bytes, mask: np.ndarray) -> bytes:
    """The 16-byte keys of a key blob where the boolean ``mask`` is set, back to back."""
    return np.frombuffer(blob, dtype="V16")[mask].tobytes()  # type: ignore[no-any-return]


def page_keys(tokens: Tokens, layout: KVLayout, namespace: bytes) -> list[PageKey]:
    """Keys of every full page of ``tokens``, in order (a partial last page gets none)."""
    return split_keys(chain_keys(as_token_array(tokens), layout.tokens_per_page, namespace))


class PageKeySet(Protocol):
    """A set of 16-byte page keys: the in-memory index's membership test.

    Keys are bytes-like objects of exactly 16 bytes; another length raises ValueError,
    another type TypeError. Not thread-safe: the caller holds a lock.
    """

    def add(self, key: KeyBytes, value: int = 0) -> None: ...

    def get(self, key: KeyBytes) -> int | None: ...

    def discard(self, key: KeyBytes) -> None: ...

    def prefix_values(self, blob: KeyBytes) -> bytes: ...

    def clear(self) -> None: ...

    def prefix_len(self, blob: KeyBytes, start: int = 0) -> int: ...

    def __contains__(self, key: object) -> bool: ...

    def __len__(self) -> int: ...


def _key_bytes(key: object) -> bytes:
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise TypeError(f"page key must be bytes, got {type(key).__name__}")
    raw = bytes(key)
    if len(raw) != KEY_BYTES:
        raise ValueError(f"page key must be {KEY_BYTES} bytes, got {len(raw)}")
    return raw


class KeySet:
    """Pure-Python :class:`PageKeySet` (a dict of key bytes to a value byte), used where
    ``_native`` is absent.

    Same contract as ``tierkv._native.KeySet``; not thread-safe: the caller holds a lock.
    """

    __slots__ = ("_keys",)

    def __init__(self) -> None:
        self._keys: dict[bytes, int] = {}

    def add(self, key: KeyBytes, value: int = 0) -> None:
        if not 0 <= value <= 255:
            raise OverflowError(f"key set values lie in [0, 255], got {value}")
        self._keys[_key_bytes(key)] = value

    def get(self, key: KeyBytes) -> int | None:
        return self._keys.get(_key_bytes(key))

    def discard(self, key: KeyBytes) -> None:
        self._keys.pop(_key_bytes(key), None)

    def prefix_values(self, blob: KeyBytes) -> bytes:
        """Values of the leading present keys of ``blob``, one byte each."""
        raw = bytes(blob)
        if len(raw) % KEY_BYTES:
            raise ValueError(f"blob must hold whole {KEY_BYTES}-byte keys, got {len(raw)} bytes")
        out = bytearray()
        for i in range(0, len(raw), KEY_BYTES):
            value = self._keys.get(raw[i:i + KEY_BYTES])
            if value is None:
                break
            out.append(value)
        return bytes(out)

    def clear(self) -> None:
        self._keys.clear()

    def prefix_len(self, blob: KeyBytes, start: int = 0) -> int:
        """How many consecutive keys of ``blob`` (n * 16 bytes), from key ``start`` on, are present."""
        raw = bytes(blob)
        if len(raw) % KEY_BYTES:
            raise ValueError(f"blob must hold whole {KEY_BYTES}-byte keys, got {len(raw)} bytes")
        n = len(raw) // KEY_BYTES
        if not 0 <= start <= n:
            raise ValueError(f"start must lie in [0, {n}], got {start}")
        keys = self._keys
        for i in range(start, n):
            if raw[i * KEY_BYTES:(i + 1) * KEY_BYTES] not in keys:
                return i - start
        return n - start

    def __contains__(self, key: object) -> bool:
        return _key_bytes(key) in self._keys

    def __len__(self) -> int:
        return len(self._keys)


def new_keyset() -> PageKeySet:
    """An empty key set: the compiled one when the extension is built, else :class:`KeySet`."""
    if _native is not None:
        return _native.KeySet()  # type: ignore[no-any-return]
    return KeySet()
