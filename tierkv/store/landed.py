"""A get's landing record: how far a layer-by-layer get has come, where its consumer looks.

``Store.get(..., landed=record)`` (and ``RemoteStore.get``, the record then in the
client's shared memory, written by the daemon) reads pages layer by layer across all of
them and announces each layer as it lands, so that an engine copies layer 0 into its
cache and runs layer 0's attention while the store is still reading the later layers:

- word :data:`PAGES`: set first, the pages the get is reading (its leading pages with
  a copy in the store); the consumer may copy layers of pages ``< record[PAGES]``;
- word :data:`LAYERS`: then raised as layers land, how many leading layers of those
  pages are in the output buffer (in groups of :func:`layer_groups`).

The get's result stays the truth: its ``pages`` are the pages that landed whole and
passed their checksums. A page past it may have had layers announced and then failed
(a torn read, a checksum): its consumer must not keep what it copied of it (the vLLM
connector reports its blocks to vLLM, which recomputes them and drops that step's
output). Words are written with release and read with acquire ordering (through
``tierkv._native``), so no CPU sees a layer announced before its bytes.
"""

from __future__ import annotations

import numpy as np

from tierkv.errors import InputError

try:
    from tierkv._native import load_acquire_u64, store_release_u64  # type: ignore[attr-defined]
except ImportError:   # x86's stores are seen in order anyway; the fallback is for a build without C
    load_acquire_u64 = store_release_u64 = None

PAGES, LAYERS = 0, 1
#: Words in a record.
WORDS = 2


def layer_groups(layers: int) -> list[tuple[int, int]]:
    """The layers a layered get reads together, in order: 1, 1, 2, 4, 8, ... (the last
    group takes the rest). The first lands after one layer's bytes, so the consumer
    starts early; later groups are larger, so that a device sees fewer, larger reads
    (one per page per group) while the consumer works through the layers before them."""
    out: list[tuple[int, int]] = []
    start, size = 0, 1
    while start < layers:
        end = min(layers, start + size)
        out.append((start, end))
        start, size = end, size if not out[1:] else size * 2
    return out


def new_record() -> np.ndarray:
    """A record in this process's memory (for an in-process store)."""
    return np.zeros(WORDS, dtype=np.uint64)


def check_record(record: object) -> np.ndarray:
    """``record`` as a landing record; InputError naming what is expected."""
    if (not isinstance(record, np.ndarray) or record.dtype != np.uint64 or record.shape != (WORDS,)
            or not record.flags.c_contiguous or not record.flags.writeable
            or record.__array_interface__["data"][0] % 8):
        raise InputError(f"a landing record is a writable, aligned numpy uint64 array of {WORDS} words; got "
                         f"{type(record).__name__} {getattr(record, 'dtype', '')} {getattr(record, 'shape', '')}")
    return record


def publish(record: np.ndarray, word: int, value: int) -> None:
    """Write ``value`` to ``record[word]`` after every byte written before it."""
    if store_release_u64 is not None:
        store_release_u64(record, word, value)
    else:
        record[word] = value


def read(record: np.ndarray, word: int) -> int:
    """``record[word]``, read before whatever the caller reads next."""
    if load_acquire_u64 is not None:
        return int(load_acquire_u64(record, word))
    return int(record[word])


def reset(record: np.ndarray) -> None:
    """Nothing landed yet (the consumer calls it before it starts a get)."""
    publish(record, LAYERS, 0)
    publish(record, PAGES, 0)
