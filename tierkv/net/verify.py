"""Checking pages that arrived from a peer before they reach the caller's buffer.

Shared by both transports: a page is accepted only when the peer holds it (generation
not 0), it is at least as long as the caller's rows, its bytes hash to its meta and, when
the caller says what it expects (its own last write, or a lookup), the generation and
checksum are those. Anything else is a miss; the caller's row is written only for
accepted pages.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tierkv.errors import InputError
from tierkv.net.transport import PeerInfo, ReadResult
from tierkv.net.wire import EMPTY_GENERATION, PageMeta, page_checksum


def accept(meta: PageMeta, slot: int, data: memoryview, width: int, expect: PageMeta | None) -> bool:
    if meta.slot != slot or meta.generation == EMPTY_GENERATION or meta.length < width or len(data) != meta.length:
        return False
    if expect is not None and (expect.generation != meta.generation or expect.checksum != meta.checksum):
        return False
    return page_checksum(data) == meta.checksum


def copy_accepted(metas: Sequence[PageMeta], datas: Sequence[memoryview], slots: Sequence[int], dst: np.ndarray,
                  expect: Sequence[PageMeta | None] | None) -> ReadResult:
    width = dst.shape[1]
    ok = []
    for i, (m, d) in enumerate(zip(metas, datas)):
        good = accept(m, slots[i], d, width, expect[i] if expect is not None else None)
        if good:
            dst[i] = np.frombuffer(d, dtype=np.uint8, count=width)
        ok.append(good)
    error = None if all(ok) else f"{ok.count(False)} of {len(ok)} pages missing, stale or corrupt"
    return ReadResult(tuple(ok), tuple(metas), error)


def failed_read(slots: Sequence[int], why: str) -> ReadResult:
    return ReadResult(tuple(False for _ in slots), tuple(PageMeta(s, EMPTY_GENERATION, 0, 0) for s in slots), why)


def check_rows(buf: np.ndarray, rows: int, slot_bytes: int, what: str) -> None:
    if not isinstance(buf, np.ndarray) or buf.dtype != np.uint8 or buf.ndim != 2 or not buf.flags.c_contiguous:
        raise InputError(f"{what} must be a C-contiguous 2-D uint8 array, got {type(buf).__name__}"
                         f" {getattr(buf, 'dtype', '')} {getattr(buf, 'shape', '')}")
    if buf.shape[0] != rows:
        raise InputError(f"{rows} slots but {what} has {buf.shape[0]} rows")
    if buf.shape[1] > slot_bytes:
        raise InputError(f"{what} rows of {buf.shape[1]} bytes exceed the peer's slot size of {slot_bytes}")


def check_slots(slots: Sequence[int], num_slots: int) -> list[int]:
    """``slots`` as ints, each a slot of the peer (InputError otherwise: a one-sided RDMA
    read outside the peer's region would break the connection, not just miss)."""
    out = [int(s) for s in slots]
    bad = [s for s in out if not 0 <= s < num_slots]
    if bad:
        raise InputError(f"slot {bad[0]} is outside the peer's {num_slots} slots")
    return out


def check_generations(generations: Sequence[int], n: int) -> list[int]:
    """One generation per slot, each in 1 .. 2**64-1 (0 means empty)."""
    out = [int(g) for g in generations]
    if len(out) != n:
        raise InputError(f"{n} slots but {len(out)} generations")
    bad = [g for g in out if not 0 < g < 1 << 64]
    if bad:
        raise InputError(f"generation {bad[0]} is outside 1 .. 2**64-1")
    return out


def read_args(slots: Sequence[int], dst: np.ndarray, info: PeerInfo) -> list[int]:
    """A read's slots, checked against the peer, with its destination rows (both transports)."""
    out = check_slots(slots, info.num_slots)
    check_rows(dst, len(out), info.slot_bytes, "read destination")
    return out


def write_args(slots: Sequence[int], generations: Sequence[int], src: np.ndarray,
               info: PeerInfo) -> tuple[list[int], list[int]]:
    """A write's slots and generations, checked against the peer, with its source rows."""
    out = check_slots(slots, info.num_slots)
    gens = check_generations(generations, len(out))
    check_rows(src, len(out), info.slot_bytes, "write source")
    return out, gens
