"""Lossless, format-aware compression of KV pages at tier boundaries.

:class:`Codec` turns store pages (``uint8 [n, page_bytes]`` of one
:class:`~tierkv.layout.KVLayout`) into self-checking blobs and back, bit-exact; blobs of
incompressible pages are the page plus a 40-byte header. :mod:`tierkv.codec.auto`
decides per tier whether coding pays (``codec = "none" | "lossless" | "auto"``).
The format is in ``tierkv/codec/FORMAT.md``. Used by the store's tier transfers and by
``tierkv bench codec``.
"""

from __future__ import annotations

from tierkv.codec.auto import CodecMode, CodecThroughput, Direction, measure_throughput, should_compress
from tierkv.codec.codec import Codec, DecodeReport, native_available
from tierkv.codec.format import HEADER_BYTES, Mode, PageHeader, max_encoded_bytes, peek_header

__all__ = [
    "HEADER_BYTES", "Codec", "CodecMode", "CodecThroughput", "DecodeReport", "Direction", "Mode", "PageHeader",
    "max_encoded_bytes", "measure_throughput", "native_available", "peek_header", "should_compress",
]
