"""The portable codec: the format in numpy and Python, with the C extension's two entry points.

Two roles. It is the shipped fallback: where ``tierkv.codec._codec`` is not built (no
compiler at install, an unsupported platform), :class:`tierkv.codec.codec.Codec` runs
this instead, reading and writing the same blobs about 1000x slower. And it is the
tests' oracle: they check that each implementation decodes what the other encodes.

``encode_rows`` and ``decode_rows`` take the same arguments as their C namesakes, so
``Codec`` calls either. The modules mirror the C files: :mod:`.common` (``codec_core.h``,
``codec_common.c``), :mod:`.encode` (``codec_enc.c``), :mod:`.decode` (``codec_dec.c``,
``codec_rows.c``). Thread-safe; holds the GIL (it is mostly Python).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tierkv.codec.format import HEADER_BYTES
from tierkv.codec.portable.common import geometry_of
from tierkv.codec.portable.decode import decode_page
from tierkv.codec.portable.encode import encode_page
from tierkv.errors import InputError


def encode_rows(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, *geo: int) -> None:
    """Encodes row i of ``src`` into the front of row i of ``dst``; lengths into ``sizes``."""
    g = geometry_of(*geo)
    n = sizes.shape[0]
    if src.shape != (n, g.page_bytes) or dst.shape[0] != n or dst.shape[1] < g.page_bytes + HEADER_BYTES:
        raise InputError(f"encode_rows: {n} sizes, source {src.shape} and destination {dst.shape} do not fit "
                         f"pages of {g.page_bytes} bytes")
    for i in range(n):
        blob = encode_page(g, src[i])
        dst[i, :len(blob)] = np.frombuffer(blob, dtype=np.uint8)
        sizes[i] = len(blob)


def decode_rows(blobs: Sequence[memoryview], dst: np.ndarray, status: np.ndarray, *geo: int) -> None:
    """Decodes ``blobs[i]`` into row i of ``dst``; a status per row (0 = decoded)."""
    g = geometry_of(*geo)
    if dst.shape != (len(blobs), g.page_bytes) or status.shape != (len(blobs),):
        raise InputError(f"decode_rows: {len(blobs)} blobs, destination {dst.shape} and status {status.shape} "
                         f"do not fit pages of {g.page_bytes} bytes")
    for i, blob in enumerate(blobs):
        status[i] = int(decode_page(g, memoryview(blob).cast("B"), dst[i]))
