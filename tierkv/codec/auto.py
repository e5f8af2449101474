"""Per-tier codec choice: ``none``, ``lossless`` or ``auto`` (compress only where it makes
the transfer faster), from the codec's measured throughput and the tier's bandwidth.

The store measures a :class:`CodecThroughput` once (``measure_throughput`` on a sample
of its own pages, with the codec's thread count) and asks :func:`should_compress` per
tier and direction. A batch of up to ``PIPELINE_BYTES`` moves serially: a write costs
encoding plus moving the smaller blob, a read moving the blob plus decoding. Larger
batches are pipelined by the block tiers (the next group coded while this one moves);
the model gives them the longer stage plus half the shorter one, not the longer alone:
where moving bytes costs CPU too (this 2-core VM's O_DIRECT), the stages overlap only
partly, and with the longer stage alone auto coded at a 600 MB/s disk where coded
writes measured 0.55x raw (docs/benchmarks.md). Where the codec's threads leave the
process no core for the I/O, the store counts a pipelined batch as serial
(``tierkv.store.coding.spare_core``). Pure functions apart from the measurement.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

import numpy as np

from tierkv.codec.codec import Codec
from tierkv.errors import ConfigError, InputError


#: Batches larger than this are pipelined by the block tiers: coded (or decoded) a group
#: of about this many bytes at a time while the group before (or after) it moves.
PIPELINE_BYTES = 4 << 20


class CodecMode(enum.Enum):
    """A tier's ``codec`` setting; the value is the config spelling."""

    NONE = "none"
    LOSSLESS = "lossless"
    AUTO = "auto"

    @classmethod
    def parse(cls, value: str | CodecMode) -> CodecMode:
        if isinstance(value, CodecMode):
            return value
        if not isinstance(value, str):
            raise ConfigError(f"codec must be one of none, lossless, auto (a string), got {value!r}")
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ConfigError(f"unknown codec {value!r}; expected one of none, lossless, auto") from None


class Direction(enum.Enum):
    """Which way pages cross the tier boundary."""

    WRITE = "write"  # into the tier: encode, then move the blob
    READ = "read"    # out of the tier: move the blob, then decode


@dataclass(frozen=True)
class CodecThroughput:
    """Measured codec figures: ``ratio`` is blob bytes over page bytes; speeds are GB/s
    of page (uncompressed) bytes with ``threads`` workers."""

    ratio: float
    compress_gbps: float
    decompress_gbps: float
    threads: int

    def seconds(self, nbytes: int, tier_gbps: float, direction: Direction, pipelined: bool = False) -> float:
        """Time to move ``nbytes`` of pages through a tier of ``tier_gbps`` with the codec:
        coding plus moving the blobs, or where ``pipelined`` the longer of the two plus
        half the shorter (the module's notes say why)."""
        codec_gbps = self.compress_gbps if direction is Direction.WRITE else self.decompress_gbps
        code, move = nbytes / (codec_gbps * 1e9), nbytes * self.ratio / (tier_gbps * 1e9)
        return max(code, move) + min(code, move) / 2 if pipelined else code + move

    def speeds_up(self, tier_gbps: float, direction: Direction, pipelined: bool = False) -> bool:
        """Whether coding makes moving pages through this tier faster than moving them raw."""
        if tier_gbps <= 0:
            raise InputError(f"tier bandwidth must be positive, got {tier_gbps} GB/s")
        return self.seconds(1 << 30, tier_gbps, direction, pipelined) < (1 << 30) / (tier_gbps * 1e9)


def should_compress(mode: CodecMode | str, throughput: CodecThroughput | None, tier_gbps: float,
                    direction: Direction, pipelined: bool = False) -> bool:
    """The decision for one tier and direction; ``auto`` needs a measured throughput.
    ``mode`` is a CodecMode or its config spelling ("none", "lossless", "auto");
    ``pipelined``: the batch is large enough that coding and moving overlap."""
    mode = CodecMode.parse(mode)
    if mode is CodecMode.NONE:
        return False
    if mode is CodecMode.LOSSLESS:
        return True
    if throughput is None:
        raise InputError("codec 'auto' needs a measured CodecThroughput (see measure_throughput)")
    return throughput.speeds_up(tier_gbps, direction, pipelined)


#: measure_throughput's rounds a direction, at most: the best round's rate counts.
_ROUNDS = 5


def measure_throughput(codec: Codec, sample_rows: np.ndarray, min_seconds: float = 0.05,
                       batch_bytes: int = 0) -> CodecThroughput:
    """Encodes and decodes ``sample_rows`` (``uint8 [n, page_bytes]``, real pages of the
    store's layout) repeatedly for at least ``min_seconds`` each, in rounds of at least a
    fifth of it (two rounds at least, five at most); the best round's wall-clock GB/s.
    (One 50 ms average took whatever else the machine did meanwhile: on a two-core VM it
    read the encoder at 0.81 GB/s in one run and 1.39 in the next, and ``auto`` chose
    wrong at 600 MB/s of disk in both. A codec slower than a round a call, the portable
    one on large pages, takes two calls each way.)

    ``batch_bytes`` > 0 codes the sample repeated up to a batch of about that many bytes
    (the store passes ``PIPELINE_BYTES``, the most it codes at a time): a handful of pages
    times a codec's thread pool waking, not its coding (two threads decoded 8 sample
    pages at 1.8 GB/s and 4 MiB of them at 3.9 on the 2-core VM), and a batch the size
    of the caches' share times the coding alone (one thread: 3.8 GB/s on 1 MiB, 2.9 on
    8 MiB)."""
    if sample_rows.ndim != 2 or sample_rows.shape[0] == 0:
        raise InputError(f"measure_throughput needs at least one sample page, got {sample_rows.shape}")
    if batch_bytes < 0:
        raise InputError(f"batch_bytes must be >= 0, got {batch_bytes}")
    if batch_bytes > sample_rows.nbytes:
        sample_rows = np.tile(sample_rows, (-(-batch_bytes // sample_rows.nbytes), 1))[
            :max(sample_rows.shape[0], -(-batch_bytes // sample_rows.shape[1]))]
    out = np.empty((sample_rows.shape[0], codec.max_encoded_bytes), dtype=np.uint8)
    sizes = codec.encode_into(sample_rows, out)
    blobs = [out[i, :int(sizes[i])] for i in range(sample_rows.shape[0])]
    back = np.empty_like(sample_rows)
    if not codec.decode_into(blobs, back).ok:  # pragma: no cover - the codec's own output
        raise InputError("the codec could not decode its own sample pages")

    def rate(fn: object) -> float:
        best, spent, rounds = 0.0, 0.0, 0
        while rounds < 2 or (spent < min_seconds and rounds < _ROUNDS):
            runs, t0 = 0, time.perf_counter()
            while True:
                fn()  # type: ignore[operator]
                runs += 1
                elapsed = time.perf_counter() - t0
                if elapsed >= min_seconds / _ROUNDS:
                    break
            best = max(best, runs * sample_rows.nbytes / elapsed / 1e9)
            spent, rounds = spent + elapsed, rounds + 1
        return best

    compress = rate(lambda: codec.encode_into(sample_rows, out))
    decompress = rate(lambda: codec.decode_into(blobs, back))
    return CodecThroughput(float(sizes.sum()) / sample_rows.nbytes, compress, decompress, codec.threads)
