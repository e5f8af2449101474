"""Whether a block-addressed tier codes the pages it is about to store.

One :class:`CodecChoice` per tier holds its ``codec`` setting (``none``, ``lossless``,
``auto``) and, for ``auto``, the two figures :func:`tierkv.codec.should_compress`
weighs: the codec's throughput, measured once per process on the first pages the
tier stores (and cached for every tier of the same layout and thread count), and the
tier's bandwidth per direction, either the configured ``bandwidth_gbps`` hint or
measured from the tier's own transfers. Called by :mod:`tierkv.tiers.blocks` with the
store lock held; no I/O here apart from the one-off codec measurement.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from tierkv.codec import Codec, CodecMode, CodecThroughput, Direction, measure_throughput, should_compress

log = logging.getLogger(__name__)

# Measured once per process: (layout fingerprint, threads, native) -> throughput.
_MEASURED: dict[tuple[bytes, int, bool], CodecThroughput] = {}
_MEASURE_LOCK = threading.Lock()
# Pages of the first batch used as the measurement sample (more add time, not accuracy).
_SAMPLE_PAGES = 8
# Weight of the newest transfer in the bandwidth average.
_EWMA = 0.25
# Transfers smaller than this say more about syscall latency than bandwidth.
_MIN_SAMPLE_BYTES = 1 << 20


def codec_throughput(codec: Codec, sample_rows: np.ndarray) -> CodecThroughput:
    """The codec's throughput on pages like ``sample_rows``, measured on first use."""
    key = (codec.layout.fingerprint(), codec.threads, codec.native)
    with _MEASURE_LOCK:
        tp = _MEASURED.get(key)
        if tp is None:
            tp = measure_throughput(codec, np.ascontiguousarray(sample_rows[:_SAMPLE_PAGES]), min_seconds=0.05)
            _MEASURED[key] = tp
            log.info("codec throughput: ratio %.3f, encode %.2f GB/s, decode %.2f GB/s (%d threads)",
                     tp.ratio, tp.compress_gbps, tp.decompress_gbps, tp.threads)
        return tp


class BandwidthMeter:
    """A running average of one tier's transfer rate per direction, in GB/s of bytes moved."""

    def __init__(self) -> None:
        self._gbps: dict[Direction, float] = {}

    def note(self, direction: Direction, nbytes: int, seconds: float) -> None:
        if nbytes < _MIN_SAMPLE_BYTES or seconds <= 0:
            return
        rate = nbytes / seconds / 1e9
        old = self._gbps.get(direction)
        self._gbps[direction] = rate if old is None else (1 - _EWMA) * old + _EWMA * rate

    def gbps(self, direction: Direction) -> float | None:
        return self._gbps.get(direction)


class CodecChoice:
    """The codec decision of one tier. ``hint_gbps`` > 0 fixes the tier bandwidth that
    ``auto`` assumes; 0 means measure it (until both directions have been measured,
    ``auto`` stores pages raw, which is also what measures them)."""

    def __init__(self, mode: CodecMode, codec: Codec | None, hint_gbps: float = 0.0) -> None:
        if mode is not CodecMode.NONE and codec is None:
            raise ValueError("a codec mode other than none needs a Codec")
        self.mode = mode
        self.codec = codec
        self.hint_gbps = hint_gbps
        self.meter = BandwidthMeter()

    def tier_gbps(self, direction: Direction) -> float | None:
        return self.hint_gbps if self.hint_gbps > 0 else self.meter.gbps(direction)

    def compress(self, rows: np.ndarray) -> bool:
        """Whether to code ``rows``, pages about to be written.

        ``auto`` codes only when coding speeds up both directions: a page's stored form
        fixes how it is read back, and a serving engine waits on the reads.
        """
        if self.mode is not CodecMode.AUTO:
            return self.mode is CodecMode.LOSSLESS
        assert self.codec is not None
        write_gbps, read_gbps = self.tier_gbps(Direction.WRITE), self.tier_gbps(Direction.READ)
        if write_gbps is None or read_gbps is None or rows.shape[0] == 0:
            return False
        tp = codec_throughput(self.codec, rows)
        return (should_compress(self.mode, tp, write_gbps, Direction.WRITE)
                and should_compress(self.mode, tp, read_gbps, Direction.READ))
