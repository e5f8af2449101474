"""Deterministic page keys: prefix-chained xxh3-128 salted per model, layout and tenant.

The key of page ``i`` is ``xxh3_128(key[i-1] || tokens[i*P:(i+1)*P] as uint32 LE)``,
where ``key[-1]`` is the namespace digest of (model id, layout, tenant salt) and
``P`` is the layout's tokens per page. Keys are the canonical (big-endian) 16-byte
digests, identical across processes, restarts and machines; Python's ``hash()`` is
never involved. Only full pages get keys.

The chain runs in C (``tierkv._native``) when the extension is built, otherwise in a
Python loop over the ``xxhash`` package; both give the same bytes (tested). Called by
the API for every lookup, put and get.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import NewType, Protocol

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


def native_available() -> bool:
    """Whether the compiled key chain is in use."""
    return _native is not None


def namespace_digest(model_id: str, layout: KVLayout, tenant: str | bytes = b"") -> bytes:
    """The 16-byte chain seed of one (model, layout, tenant) namespace.

    Pages of different tenants never share a key, on any tier, because the seed differs.
    """
    if not isinstance(model_id, str) or not model_id:
        raise InputError(f"model_id must be a non-empty string, got {model_id!r}")
    if isinstance(tenant, str):
        tenant = tenant.encode()
    if not isinstance(tenant, bytes):
        raise InputError(f"tenant salt must be str or bytes, got {type(tenant).__name__}")
    header = json.dumps({"v": 1, "model": model_id, "layout": layout.fingerprint().decode()},
                        sort_keys=True).encode()
    # Length-prefix each part so that no (model, tenant) pair can collide with another.
    material = len(header).to_bytes(8, "little") + header + len(tenant).to_bytes(8, "little") + tenant
    return xxhash.xxh3_128_digest(b"tierkv-namespace\0" + material)


def as_token_array(tokens: Tokens) -> np.ndarray:
    """Tokens as a contiguous little-endian uint32 array; raises InputError otherwise."""
    if hasattr(tokens, "numpy") and not isinstance(tokens, np.ndarray):
        tensor = tokens
        if getattr(tensor, "device", None) is not None and str(tensor.device) != "cpu":  # type: ignore[attr-defined]
            tensor = tensor.cpu()  # type: ignore[attr-defined]
        arr = np.asarray(tensor.numpy())
    else:
        arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise InputError(f"tokens must be one-dimensional, got shape {tuple(arr.shape)}")
    if arr.size == 0:
        return np.zeros(0, dtype="<u4")
    if arr.dtype.kind not in "iu":
        raise InputError(f"tokens must be integers, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi > _MAX_TOKEN:
        raise InputError(f"token ids must lie in [0, {_MAX_TOKEN}], got values in [{lo}, {hi}]")
    return np.ascontiguousarray(arr, dtype="<u4")


def chain_keys(tokens: np.ndarray, tokens_per_page: int, namespace: bytes) -> bytes:
    """Keys of every full page of ``tokens`` (from :func:`as_token_array`), concatenated.

    Returns ``n_full_pages * 16`` bytes; key ``i`` is ``result[16*i:16*(i+1)]``.
    """
    if len(namespace) != KEY_BYTES:
        raise InputError(f"namespace digest must be {KEY_BYTES} bytes, got {len(namespace)}")
    n_pages = tokens.size // tokens_per_page
    if n_pages == 0:
        return b""
    if _native is not None:
        return bytes(_native.chain_xxh3_128(namespace, tokens, tokens_per_page, n_pages))
    raw = tokens[: n_pages * tokens_per_page].tobytes()
    step = tokens_per_page * 4
    digest = xxhash.xxh3_128_digest
    prev = namespace
    out = bytearray(n_pages * KEY_BYTES)
    for i in range(n_pages):
        prev = digest(prev + raw[i * step:(i + 1) * step])
        out[i * KEY_BYTES:(i + 1) * KEY_BYTES] = prev
    return bytes(out)


def split_keys(blob: bytes) -> list[PageKey]:
    """The 16-byte keys of a :func:`chain_keys` result, in page order."""
    return [PageKey(blob[i:i + KEY_BYTES]) for i in range(0, len(blob), KEY_BYTES)]


def page_keys(tokens: Tokens, layout: KVLayout, namespace: bytes) -> list[PageKey]:
    """Keys of every full page of ``tokens``, in order (a partial last page gets none)."""
    return split_keys(chain_keys(as_token_array(tokens), layout.tokens_per_page, namespace))
