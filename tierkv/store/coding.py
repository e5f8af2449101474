"""Whether a block-addressed tier codes the pages it is about to store.

One :class:`CodecChoice` per tier holds its ``codec`` setting (``none``, ``lossless``,
``auto``) and, for ``auto``, the two figures :func:`tierkv.codec.should_compress`
weighs: the codec's speed, measured once per process on the first pages the tier
stores (and cached for every tier of the same layout and thread count); the ratio the
tier's own pages code to, kept per tier from the pages it codes and, while it stores
raw, from a page sampled every ``_RESAMPLE_BATCHES`` batches (so a first batch of
incompressible pages does not decide for the tier's life); and the tier's bandwidth
per direction, either the configured ``bandwidth_gbps`` hint or measured from the
tier's own transfers. Called by :mod:`tierkv.tiers.blocks` with the
store lock held; no I/O here apart from the one-off codec measurement.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading

import numpy as np

from tierkv.codec import Codec, CodecMode, CodecThroughput, Direction, measure_throughput, should_compress
from tierkv.codec.auto import PIPELINE_BYTES
from tierkv.tiers.aligned import ALIGN

log = logging.getLogger(__name__)

# Measured once per process: (layout fingerprint, threads, native) -> throughput.
_MEASURED: dict[tuple[bytes, int, bool], CodecThroughput] = {}
_MEASURE_LOCK = threading.Lock()
# Pages of the first batch used as the measurement sample (more add time, not accuracy),
# repeated up to a batch of PIPELINE_BYTES: the codec's speed on the batches it codes.
_SAMPLE_PAGES = 8
# Weight of the newest transfer in the bandwidth average.
_EWMA = 0.25
# Transfers smaller than this say more about syscall latency than bandwidth.
_MIN_SAMPLE_BYTES = 1 << 20
# While auto stores raw, one page of every this many batches is coded to refresh the ratio.
_RESAMPLE_BATCHES = 16
# Weight of the newest batch in a tier's coding ratio.
_RATIO_EWMA = 0.5


def codec_throughput(codec: Codec, sample_rows: np.ndarray) -> CodecThroughput:
    """The codec's throughput on pages like ``sample_rows``, measured on first use."""
    key = (codec.layout.fingerprint(), codec.threads, codec.native)
    with _MEASURE_LOCK:
        tp = _MEASURED.get(key)
        if tp is None:
            tp = measure_throughput(codec, np.ascontiguousarray(sample_rows[:_SAMPLE_PAGES]), min_seconds=0.05,
                                    batch_bytes=PIPELINE_BYTES)
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
        self._ratio: float | None = None  # blob bytes over page bytes of this tier's pages
        self._raw_batches = 0
        # The last auto decision: whether it coded, and the figures it weighed (None
        # before the tier's bandwidth was known both ways).
        self._coded: bool | None = None
        self._weighed: tuple[CodecThroughput, float, float, bool, bool, bool] | None = None

    @property
    def ratio(self) -> float | None:
        """The coding ratio of this tier's recent pages (None before auto has sampled one)."""
        return self._ratio

    def observe(self, page_bytes: int, blob_bytes: int) -> None:
        """Pages of ``page_bytes`` in all coded to ``blob_bytes``: the tier's ratio follows."""
        if page_bytes <= 0:
            return
        r = blob_bytes / page_bytes
        self._ratio = r if self._ratio is None else (1 - _RATIO_EWMA) * self._ratio + _RATIO_EWMA * r

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
        if rows.shape[0] == 0:
            return False
        if write_gbps is None or read_gbps is None:
            self._coded, self._weighed = False, None
            return False
        tp = codec_throughput(self.codec, rows)
        if self._ratio is None or self._raw_batches >= _RESAMPLE_BATCHES:
            sample = np.ascontiguousarray(rows[:1])
            out = np.empty((1, self.codec.max_encoded_bytes), dtype=np.uint8)
            self.observe(sample.nbytes, int(self.codec.encode_into(sample, out).sum()))
            self._raw_batches = 0
        assert self._ratio is not None
        mine = dataclasses.replace(tp, ratio=self._ratio)
        write_piped, read_piped = pipelines(rows, self._ratio)
        spare = spare_core(self.codec.threads)
        code = (should_compress(self.mode, mine, write_gbps, Direction.WRITE, write_piped and spare)
                and should_compress(self.mode, mine, read_gbps, Direction.READ, read_piped and spare))
        self._raw_batches = 0 if code else self._raw_batches + 1
        self._coded, self._weighed = code, (mine, write_gbps, read_gbps, write_piped, read_piped, spare)
        return code

    def describe(self) -> dict[str, object]:
        """The tier's codec choice for ``stats()``: ``mode`` (its setting), ``coding``
        (whether the pages it stores now are coded; None while ``auto`` has stored
        nothing), ``reason`` (a sentence), and the figures ``auto`` weighed last:
        ``ratio``, ``encode_gbps``, ``decode_gbps`` (the codec's measured speeds) and the
        tier's ``write_gbps`` and ``read_gbps`` (measured, or the ``bandwidth_gbps``
        hint); None where not known."""
        out: dict[str, object] = {"mode": self.mode.value, "coding": None, "reason": "", "ratio": self._ratio,
                                  "encode_gbps": None, "decode_gbps": None,
                                  "write_gbps": self.tier_gbps(Direction.WRITE),
                                  "read_gbps": self.tier_gbps(Direction.READ)}
        if self.mode is CodecMode.NONE:
            out.update(coding=False, reason="codec = none: pages are stored raw")
        elif self.mode is CodecMode.LOSSLESS:
            out.update(coding=True, reason="codec = lossless: every page is coded")
        elif self._coded is None:
            out["reason"] = "auto: nothing stored since the tier opened"
        elif self._weighed is None:
            out.update(coding=False, reason="auto: stored raw until the bandwidth of the tier is measured both "
                                            "ways (bandwidth_gbps sets it)")
        else:
            tp, write_gbps, read_gbps, write_piped, read_piped, spare = self._weighed
            out.update(coding=self._coded, ratio=tp.ratio, encode_gbps=tp.compress_gbps,
                       decode_gbps=tp.decompress_gbps, write_gbps=write_gbps, read_gbps=read_gbps)
            out["reason"] = _auto_reason(tp, write_gbps, read_gbps, self._coded, write_piped, read_piped, spare)
        return out


def pipelines(rows: np.ndarray, ratio: float) -> tuple[bool, bool]:
    """Whether a block tier pipelines the write of ``rows`` (pages coded together) and,
    a batch written together being mostly read together (a prompt's pages), their read:
    a write is grouped by raw pages (more than one group of PIPELINE_BYTES), a read by
    the coded blocks it moves (more than PIPELINE_BYTES of them, and two pages or more)."""
    n, width = rows.shape
    per = max(1, PIPELINE_BYTES // (-(-width // ALIGN) * ALIGN))
    return n > per, n > 1 and rows.nbytes * ratio > PIPELINE_BYTES


def spare_core(codec_threads: int) -> bool:
    """Whether this process has a core beyond the codec's threads: a pipelined batch's
    coding overlaps its I/O only where the I/O has a core to run on (moving bytes costs
    CPU: syscalls and completions, on a VM's virtual disk half the wall time). Without
    one, auto counts a pipelined batch as coded then moved: on the 2-core VM, with the
    codec on both cores, the overlap model coded at a 600 MB/s disk where coded writes
    measured 0.77-0.93x raw (docs/benchmarks.md)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - platforms without affinity
        cores = os.cpu_count() or 1
    return cores > codec_threads


def _auto_reason(tp: CodecThroughput, write_gbps: float, read_gbps: float, coded: bool, write_piped: bool,
                 read_piped: bool, spare: bool = True) -> str:
    """Why auto coded or not, in seconds per GiB of pages each way, coded vs raw, each
    direction as its batch moves (pipelined, or coded then moved; pipelined without a
    core to spare for the I/O counts as the latter)."""
    gib = 1 << 30
    parts = []
    for name, direction, gbps, piped in (("read", Direction.READ, read_gbps, read_piped),
                                         ("write", Direction.WRITE, write_gbps, write_piped)):
        how = ("pipelined" if spare else "pipelined, no core to spare: counted serial") if piped else "serial"
        parts.append(f"{name} ({how}) {tp.seconds(gib, gbps, direction, piped and spare):.3f} s/GiB coded vs "
                     f"{gib / (gbps * 1e9):.3f} raw")
    figures = (f"ratio {tp.ratio:.3f}, decode {tp.decompress_gbps:.3g} and encode {tp.compress_gbps:.3g} GB/s, "
               f"tier read {read_gbps:.3g} and write {write_gbps:.3g} GB/s")
    verdict = "coded: faster both ways" if coded else "raw: coding is not faster both ways"
    return f"auto, {verdict} ({'; '.join(parts)}; {figures})"
