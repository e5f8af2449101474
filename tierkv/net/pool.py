"""An allocator of registered memory: size classes over one big buffer.

RDMA needs every local buffer that a READ lands in or a WRITE comes from to lie in a
memory region registered with the NIC, and registering costs a syscall and page pinning,
so the transports register one buffer once and carve it here. Pages vary in size (a
compressed page is smaller than its slot), so the buffer is split into *chunks* of
``chunk_bytes``; a chunk is given to one size class on first need and cut into blocks
of that class (a slab allocator); a chunk whose blocks are all free goes back to the
chunk list, so classes do not fragment the buffer for good. Requests above the largest
class take a run of whole chunks. For TCP the buffer is plain memory; for RDMA the same
buffer is the MR (``buffer`` is what :mod:`tierkv.net.rdma` registers).

Thread-safe. ``allocate`` returns None when the pool cannot fit the request (callers
fall back to unregistered memory or wait); it never raises on exhaustion.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from tierkv.errors import InputError
from tierkv.tiers.aligned import aligned_empty


@dataclass(frozen=True)
class Block:
    """``size`` bytes at ``offset`` in the pool's buffer (``size`` is the class size or a
    multiple of whole chunks, at least the ``length`` asked for)."""

    offset: int
    size: int
    length: int


def size_classes(min_bytes: int, max_bytes: int) -> tuple[int, ...]:
    """Powers of two from ``min_bytes`` to ``max_bytes``, with the midpoint between each
    pair (4 KiB, 6 KiB, 8 KiB, 12 KiB ...), so a page wastes at most a third."""
    out: list[int] = []
    c = min_bytes
    while c <= max_bytes:
        out.append(c)
        if c + c // 2 <= max_bytes and c >= 4:
            out.append(c + c // 2)
        c *= 2
    return tuple(sorted(set(out)))


class PagePool:
    def __init__(self, capacity_bytes: int, chunk_bytes: int = 1 << 20, min_class_bytes: int = 4096) -> None:
        if chunk_bytes <= 0 or capacity_bytes < chunk_bytes or min_class_bytes > chunk_bytes:
            raise InputError(f"page pool of {capacity_bytes} bytes needs at least one chunk of {chunk_bytes}"
                             f" and classes of at most {chunk_bytes} (min class {min_class_bytes})")
        self.chunk_bytes = chunk_bytes
        self.num_chunks = capacity_bytes // chunk_bytes
        self.classes = size_classes(min_class_bytes, chunk_bytes)
        self.buffer = aligned_empty(self.num_chunks * chunk_bytes)
        self._lock = threading.Lock()
        self._free_chunks = bytearray(b"\x01") * self.num_chunks  # 1 = free
        self._chunk_class: dict[int, int] = {}                    # chunk -> class size
        self._chunk_used: dict[int, int] = {}                     # chunk -> blocks in use
        self._free_blocks: dict[int, list[int]] = {c: [] for c in self.classes}  # class -> offsets
        self.in_use_bytes = 0

    @property
    def capacity_bytes(self) -> int:
        return self.num_chunks * self.chunk_bytes

    def class_for(self, length: int) -> int:
        """The smallest class that holds ``length`` bytes; 0 above the largest (whole chunks)."""
        for c in self.classes:
            if c >= length:
                return c
        return 0

    def allocate(self, length: int) -> Block | None:
        if length <= 0:
            raise InputError(f"page pool allocation of {length} bytes")
        cls = self.class_for(length)
        with self._lock:
            if cls == 0:
                return self._allocate_chunks(length)
            free = self._free_blocks[cls]
            if not free and not self._carve(cls):
                return None
            off = free.pop()
            chunk = off // self.chunk_bytes
            self._chunk_used[chunk] += 1
            self.in_use_bytes += cls
            return Block(off, cls, length)

    def free(self, block: Block) -> None:
        with self._lock:
            chunk = block.offset // self.chunk_bytes
            if block.size > self.chunk_bytes or self._chunk_class.get(chunk) == -1:
                n = -(-block.size // self.chunk_bytes)
                for c in range(chunk, chunk + n):
                    self._chunk_class.pop(c, None)
                    self._free_chunks[c] = 1
                self.in_use_bytes -= block.size
                return
            cls = self._chunk_class.get(chunk)
            if cls != block.size:
                raise InputError(f"block at {block.offset} of {block.size} bytes is not allocated from this pool")
            self._free_blocks[cls].append(block.offset)
            self._chunk_used[chunk] -= 1
            self.in_use_bytes -= cls
            if self._chunk_used[chunk] == 0:  # give the chunk back to every class
                base = chunk * self.chunk_bytes
                self._free_blocks[cls] = [o for o in self._free_blocks[cls] if not base <= o < base + self.chunk_bytes]
                del self._chunk_class[chunk], self._chunk_used[chunk]
                self._free_chunks[chunk] = 1

    def view(self, block: Block) -> np.ndarray:
        """The ``length`` bytes of ``block`` (a writable view into the registered buffer)."""
        return self.buffer[block.offset:block.offset + block.length]

    def _carve(self, cls: int) -> bool:
        chunk = self._free_chunks.find(1)
        if chunk < 0:
            return False
        self._free_chunks[chunk] = 0
        self._chunk_class[chunk] = cls
        self._chunk_used[chunk] = 0
        base = chunk * self.chunk_bytes
        n = self.chunk_bytes // cls
        self._free_blocks[cls].extend(base + i * cls for i in range(n - 1, -1, -1))  # lowest offset popped first
        return True

    def _allocate_chunks(self, length: int) -> Block | None:
        n = -(-length // self.chunk_bytes)
        chunk = self._free_chunks.find(b"\x01" * n)
        if chunk < 0:
            return None
        for c in range(chunk, chunk + n):
            self._free_chunks[c] = 0
            self._chunk_class[c] = -1
        self.in_use_bytes += n * self.chunk_bytes
        return Block(chunk * self.chunk_bytes, n * self.chunk_bytes, length)
