"""The codec's API contract: validation, batch and threaded paths, blob views, the
auto decision."""

from __future__ import annotations

import numpy as np
import pytest

from tests.codec.conftest import IMPLS, normal_pages, roundtrip
from tierkv.codec import (HEADER_BYTES, Codec, CodecMode, CodecThroughput, Direction, Mode, max_encoded_bytes,
                          measure_throughput, native_available, peek_header, should_compress)
from tierkv.errors import ConfigError, InputError, StoreClosedError
from tierkv.layout import DType, KVLayout

LAYOUT = KVLayout(2, 2, 64, DType.BF16, 16)


@pytest.mark.parametrize("native", IMPLS)
def test_encode_into_leaves_the_rest_of_each_row(native: bool) -> None:
    rows = normal_pages(LAYOUT, 3)
    with Codec(LAYOUT, native=native) as codec:
        out = np.full((3, 4096 * 5), 0x5A, dtype=np.uint8)
        sizes = codec.encode_into(rows, out)
        for i in range(3):
            assert (out[i, int(sizes[i]):] == 0x5A).all()
            assert HEADER_BYTES + peek_header(out[i]).payload_bytes == sizes[i]
            assert peek_header(out[i]).mode is Mode.CODED
        assert [len(b) for b in codec.encode(rows)] == sizes.tolist()


def test_max_encoded_bytes() -> None:
    assert max_encoded_bytes(LAYOUT.page_bytes) == LAYOUT.page_bytes + HEADER_BYTES
    assert Codec(LAYOUT, native=False).max_encoded_bytes == LAYOUT.page_bytes + HEADER_BYTES
    with pytest.raises(InputError):
        max_encoded_bytes(0)


def test_input_errors_name_what_was_expected() -> None:
    with Codec(LAYOUT, native=False) as codec:
        with pytest.raises(InputError, match=r"\[n, 16384\]"):
            codec.encode(np.zeros((1, 100), dtype=np.uint8))
        with pytest.raises(InputError, match="uint8"):
            codec.encode(np.zeros((1, LAYOUT.page_bytes // 2), dtype=np.uint16))
        with pytest.raises(InputError, match="out must be"):
            codec.encode_into(np.zeros((1, LAYOUT.page_bytes), dtype=np.uint8),
                              np.zeros((1, LAYOUT.page_bytes), dtype=np.uint8))
        with pytest.raises(InputError, match="out_rows"):
            codec.decode_into([b"x"], np.zeros((2, LAYOUT.page_bytes), dtype=np.uint8))
        with pytest.raises(InputError, match="blob 0"):
            codec.decode_into([12], np.zeros((1, LAYOUT.page_bytes), dtype=np.uint8))  # type: ignore[list-item]
    with pytest.raises(InputError, match="threads"):
        Codec(LAYOUT, threads=0)


def test_closed_codec_refuses_work() -> None:
    codec = Codec(LAYOUT, threads=2, native=False)
    codec.close()
    codec.close()
    with pytest.raises(StoreClosedError):
        codec.encode(np.zeros((2, LAYOUT.page_bytes), dtype=np.uint8))


@pytest.mark.skipif(not native_available(), reason="tierkv.codec._codec is not built")
def test_threaded_batches_match_single_thread() -> None:
    rows = normal_pages(LAYOUT, 9, 4)
    with Codec(LAYOUT, threads=1) as one, Codec(LAYOUT, threads=3) as three:
        a = [bytes(b) for b in one.encode(rows)]
        b = [bytes(b) for b in three.encode(rows)]
        assert a == b
        back = np.zeros_like(rows)
        assert three.decode_into(a, back).ok
        np.testing.assert_array_equal(back, rows)


def test_codec_mode_parse() -> None:
    assert CodecMode.parse("Lossless") is CodecMode.LOSSLESS
    assert CodecMode.parse(CodecMode.AUTO) is CodecMode.AUTO
    with pytest.raises(ConfigError, match="none, lossless, auto"):
        CodecMode.parse("zstd")


def test_auto_compresses_only_where_it_pays() -> None:
    t = CodecThroughput(ratio=0.65, compress_gbps=2.0, decompress_gbps=8.0, threads=4)
    # reads: decoding at 8 GB/s pays on a 1 GB/s tier (0.125 + 0.65 < 1), not on a 10 GB/s one
    assert should_compress(CodecMode.AUTO, t, 1.0, Direction.READ)
    assert not should_compress(CodecMode.AUTO, t, 10.0, Direction.READ)
    # writes: encoding at 2 GB/s does not pay on a 1 GB/s tier (0.5 + 0.65 > 1)
    assert not should_compress(CodecMode.AUTO, t, 1.0, Direction.WRITE)
    assert should_compress(CodecMode.AUTO, t, 0.5, Direction.WRITE)
    # pipelined (coding overlaps moving): the longer stage plus half the shorter,
    # 0.65 + 0.25 < 1 at 1 GB/s ...
    assert should_compress(CodecMode.AUTO, t, 1.0, Direction.WRITE, pipelined=True)
    # ... and never faster than the codec: 0.5 + 0.13 > 1 / 2.5
    assert not should_compress(CodecMode.AUTO, t, 2.5, Direction.WRITE, pipelined=True)
    assert t.seconds(1_000_000_000, 1.0, Direction.READ, pipelined=True) == pytest.approx(0.65 + 0.0625)
    assert t.seconds(1_000_000_000, 1.0, Direction.READ) == pytest.approx(0.775)
    assert should_compress(CodecMode.LOSSLESS, None, 100.0, Direction.WRITE)
    assert not should_compress(CodecMode.NONE, t, 0.01, Direction.READ)
    with pytest.raises(InputError, match="measured"):
        should_compress(CodecMode.AUTO, None, 1.0, Direction.READ)


def test_modes_spelled_as_in_the_config_and_bad_arguments_name_what_was_expected() -> None:
    from tierkv.codec import peek_header
    from tierkv.config import NvmeConfig
    t = CodecThroughput(ratio=0.5, compress_gbps=100.0, decompress_gbps=100.0, threads=1)
    assert not should_compress("none", t, 0.01, Direction.WRITE)       # was taken for "code it"
    assert should_compress("lossless", None, 1.0, Direction.WRITE)
    assert should_compress("auto", t, 0.01, Direction.WRITE)
    with pytest.raises(ConfigError, match="none, lossless, auto"):
        should_compress("zstd", t, 1.0, Direction.WRITE)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="a string"):
        NvmeConfig(1 << 20, codec=None)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="KVLayout"):
        Codec("bf16")  # type: ignore[arg-type]
    with pytest.raises(InputError, match="blob's bytes"):
        peek_header("TK" * 30)  # type: ignore[arg-type]


@pytest.mark.parametrize("native", IMPLS)
def test_measure_throughput(native: bool) -> None:
    rows = normal_pages(LAYOUT, 2)
    with Codec(LAYOUT, native=native) as codec:
        t = measure_throughput(codec, rows, min_seconds=0.001)
        roundtrip(codec, rows)
    assert 0 < t.ratio < 1 and t.compress_gbps > 0 and t.decompress_gbps > 0 and t.threads == 1


def test_measure_throughput_takes_its_best_round() -> None:
    """A stall (another process on the core, a page fault) in one call must not stand for
    the codec's speed: the rate is the best of five rounds, not one average. The first
    encode after the warm-up stalls 50 ms; one average over 50 ms would be one call's
    worth of bytes a 50 ms, the best round is many calls a round."""
    import time

    rows = normal_pages(LAYOUT, 2)

    class Stalls:
        def __init__(self, codec: Codec) -> None:
            self.codec, self.calls = codec, 0
            self.max_encoded_bytes, self.threads = codec.max_encoded_bytes, codec.threads

        def encode_into(self, src: np.ndarray, out: np.ndarray) -> np.ndarray:
            self.calls += 1
            if self.calls == 2:   # the first timed call
                time.sleep(0.05)
            return self.codec.encode_into(src, out)

        def decode_into(self, blobs: list[np.ndarray], out: np.ndarray) -> object:
            return self.codec.decode_into(blobs, out)

    with Codec(LAYOUT) as codec:
        t = measure_throughput(Stalls(codec), rows, min_seconds=0.05)  # type: ignore[arg-type]
    assert t.compress_gbps > 5 * rows.nbytes / 0.05 / 1e9


def test_measure_throughput_codes_batches_of_the_size_asked() -> None:
    """With ``batch_bytes`` the sample is repeated up to a batch of that size (the store
    asks for the size it codes at a time): every timed call codes at least that many
    bytes, and the pages decoded are the sample's."""
    rows = normal_pages(LAYOUT, 3)
    seen: list[int] = []

    class Counts:
        def __init__(self, codec: Codec) -> None:
            self.codec = codec
            self.max_encoded_bytes, self.threads = codec.max_encoded_bytes, codec.threads

        def encode_into(self, src: np.ndarray, out: np.ndarray) -> np.ndarray:
            seen.append(src.nbytes)
            return self.codec.encode_into(src, out)

        def decode_into(self, blobs: list[np.ndarray], out: np.ndarray) -> object:
            seen.append(out.nbytes)
            report = self.codec.decode_into(blobs, out)
            np.testing.assert_array_equal(out, np.tile(rows, (-(-out.shape[0] // 3), 1))[:out.shape[0]])
            return report

    want = 40 * LAYOUT.page_bytes + 5
    with Codec(LAYOUT) as codec:
        t = measure_throughput(Counts(codec), rows, min_seconds=0.001, batch_bytes=want)  # type: ignore[arg-type]
        small = measure_throughput(codec, rows, min_seconds=0.001)
    assert min(seen) == 41 * LAYOUT.page_bytes and len(seen) >= 6
    assert t.ratio == pytest.approx(small.ratio, rel=0.01)   # 41 pages: 13 whole copies of 3 and two
    with Codec(LAYOUT) as codec, pytest.raises(InputError, match="batch_bytes"):
        measure_throughput(codec, rows, batch_bytes=-1)


def test_portable_codec_runs_where_the_extension_is_missing(monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    import tierkv.codec.codec as codec_module

    monkeypatch.setattr(codec_module, "_native", None)
    monkeypatch.setattr(codec_module, "_warned_portable", False)
    with caplog.at_level("WARNING"):
        codec = Codec(KVLayout(1, 1, 16, DType.FP16, 4))
    assert not codec.native and "not built" in caplog.text
    roundtrip(codec, normal_pages(codec.layout, 2))
    with pytest.raises(InputError, match="not built"):
        Codec(LAYOUT, native=True)


@pytest.mark.skipif(not native_available(), reason="tierkv.codec._codec is not built")
def test_one_codec_from_many_threads() -> None:
    from concurrent.futures import ThreadPoolExecutor

    rows = normal_pages(LAYOUT, 8, 9)
    with Codec(LAYOUT, threads=2) as codec:
        expect = [bytes(b) for b in codec.encode(rows)]

        def work(seed: int) -> bool:
            for _ in range(20):
                blobs = codec.encode(rows)
                back = np.zeros_like(rows)
                if [bytes(b) for b in blobs] != expect or not codec.decode_into(blobs, back).ok:
                    return False
                if not np.array_equal(back, rows):
                    return False
            return True

        with ThreadPoolExecutor(4) as pool:
            assert all(pool.map(work, range(4)))


def test_a_split_batch_waits_for_every_chunk_taken_before_it_raises() -> None:
    """The calling thread and the pool's take chunks of a batch in turn; whichever chunk
    fails, the call returns only after every chunk taken has ended (they all write into
    the caller's arrays), takes no chunk after the failure, and raises it."""
    import time

    with Codec(LAYOUT, threads=3) as codec:
        ended: list[int] = []
        started: list[int] = []

        def work(a: int, b: int) -> None:
            started.append(a)
            if a == 4:
                raise ValueError("the second chunk failed")
            time.sleep(0.1)               # the first chunk is still being coded when it fails
            ended.append(a)

        with pytest.raises(ValueError, match="second chunk"):
            codec._split(12, work)        # chunks of 4 pages: 0, 4, 8
        assert ended == [0] and sorted(started) == [0, 4]

        ended.clear()

        def late_failure(a: int, b: int) -> None:
            if a == 8:
                time.sleep(0.05)
                raise ValueError("the last share failed")
            ended.append(a)

        with pytest.raises(ValueError, match="last share"):
            codec._split(12, late_failure)
        assert sorted(ended) == [0, 4]


def test_a_split_batch_is_coded_by_the_caller_where_the_pool_is_busy() -> None:
    """Every pool thread busy: the caller codes every chunk itself, waiting for none."""
    import threading

    from tests.polling import ends_while_busy

    with Codec(LAYOUT, threads=2) as codec:
        assert codec._pool is not None
        by: list[str] = []
        ends_while_busy(codec._pool, 2, lambda: codec._split(64, lambda a, b: by.append(
            threading.current_thread().name)))
        assert by == ["caller"] * 8     # 64 pages in chunks of 8
