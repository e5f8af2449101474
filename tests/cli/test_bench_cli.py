"""``tierkv bench`` on bad input: a file that is not safetensors, a ``--dir`` that is not a
directory. Each is one ``tierkv: error: ...`` line and exit status 2, before any measuring."""

from __future__ import annotations

import importlib.util
import json
import re
import struct
from pathlib import Path

import pytest

from tierkv.bench.codec import load_kv
from tierkv.cli.main import main
from tierkv.errors import InputError


def _safetensors(header: object, data: bytes = b"") -> bytes:
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + data


@pytest.mark.parametrize("content, why", [
    (b"garbage\n", "header length .* past the end of its 8 bytes"),
    (b'{"layer00.k": 1}\n', "header length .* past the end"),
    (b"x", "1 bytes, shorter than the 8-byte header length"),
    (struct.pack("<Q", 4) + b"{no}", "header is not JSON"),
    (struct.pack("<Q", 2) + b"\xff\xfe", "header is not JSON"),
    (_safetensors([1, 2]), "header is JSON list, not an object"),
    (_safetensors({"layer00.k": "BF16"}), "layer00.k: expected dtype, shape and data_offsets"),
    (_safetensors({"layer00.k": {"dtype": "BF16", "shape": [1, 1, 2], "data_offsets": [0, 4]}}, b"ab"),
     r"layer00.k: data_offsets \[0, 4\] outside its 2 data bytes"),
    (_safetensors({"layer00.k": {"dtype": "BF16", "shape": [1, 1, 2], "data_offsets": [0, 2]}}, b"ab"),
     r"layer00.k: data_offsets \[0, 2\] do not hold BF16 \[1, 1, 2\]"),
], ids=["text", "json", "short", "bad-json", "not-utf8", "json-list", "bad-entry", "past-end", "wrong-size"])
def test_not_safetensors_is_input_error(tmp_path: Path, content: bytes, why: str) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(content)
    with pytest.raises(InputError, match=f"^{re.escape(str(bad))} is not a safetensors file \\({why}"):
        load_kv(bad)


@pytest.mark.parametrize("suite", ["codec", "codec-store"])
def test_bench_on_a_non_safetensors_file_is_one_line(suite: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_text("garbage")
    assert main(["bench", suite, "--kv", str(bad), "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(f"tierkv: error: {bad} is not a safetensors file (")


@pytest.mark.parametrize("suite", ["store", "codec-store"])
def test_bench_dir_must_be_a_directory(suite: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("")
    for path in (tmp_path / "missing", tmp_path / "file"):
        assert main(["bench", suite, "--quick", "--json", "--dir", str(path)]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err == f"tierkv: error: --dir: {path} is not a directory\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_the_nvme_baseline_is_tuned_as_the_tier_is(tmp_path: Path) -> None:
    """fio's queue depth is swept as the tier's I/O threads are, and the timed fio runs use
    the best depth of the sweep for reads and for writes."""
    import shutil

    if shutil.which("fio") is None:
        pytest.skip("fio is not installed")
    from tierkv.bench.io import bench_nvme

    out = bench_nvme(tmp_path, 64 << 10, 8, 1, (1, 8), io_threads_options=(2,))
    sweep = out["fio_queue_depth_sweep"]
    depth = out["fio_queue_depth"]
    assert isinstance(sweep, dict) and isinstance(depth, dict) and set(sweep) == {1, 8}
    for rw in ("read", "write"):
        assert sweep[depth[rw]][f"{rw}_gbps"] == max(v[f"{rw}_gbps"] for v in sweep.values())
    assert out["verified"] is True
    for kind in ("", "_unaligned", "_huge", "_pool"):   # every buffer kind timed and compared with fio
        for rw in ("read", "write"):
            gbps, ratio = out[f"nvme_{rw}{kind}_gbps"], out[f"nvme_{rw}{kind}_vs_fio"]
            assert isinstance(gbps, float) and isinstance(ratio, float) and gbps > 0 and ratio > 0


# -- where the codec suites find KV pages ---------------------------------------------------


def _tiny_kv(path: Path) -> Path:
    """Two layers of K and V, BF16 [2 heads, 24 tokens, 32]: three 8-token pages."""
    import torch

    g = torch.Generator().manual_seed(0)
    header, blobs, offset = {}, [], 0
    for name in ("layer00.k", "layer00.v", "layer01.k", "layer01.v"):
        raw = torch.randn(2, 24, 32, generator=g).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": "BF16", "shape": [2, 24, 32], "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    path.write_bytes(_safetensors(header, b"".join(blobs)))
    return path


def test_kv_pages_come_from_the_environment_when_kv_is_not_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    kv = _tiny_kv(tmp_path / "tiny.safetensors")
    monkeypatch.setenv("TIERKV_KV_DIR", str(kv))
    assert main(["bench", "codec", "--page-tokens", "8", "--runs", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv"] == str(kv)
    monkeypatch.setenv("TIERKV_KV_DIR", str(tmp_path / "missing"))
    assert main(["bench", "codec", "--json"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"TIERKV_KV_DIR={tmp_path / 'missing'} does not exist" in err


@pytest.mark.parametrize("suite", ["codec", "codec-store"])
def test_without_kv_pages_the_error_names_what_to_pass(suite: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """No --kv, no TIERKV_KV_DIR, no data beside the checkout: one line naming both ways to
    give pages; a ../shared/data/kv under the current folder is never read."""
    import tierkv.bench.codec

    monkeypatch.delenv("TIERKV_KV_DIR", raising=False)
    monkeypatch.setattr(tierkv.bench.codec, "DEFAULT_KV_DIR", tmp_path / "no-checkout-data")
    beside_cwd = tmp_path / "shared" / "data" / "kv"
    beside_cwd.mkdir(parents=True)
    _tiny_kv(beside_cwd / "kv.safetensors")
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    assert main(["bench", suite, "--json", "--quick"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert "--kv" in captured.err and "TIERKV_KV_DIR" in captured.err and "no-checkout-data" in captured.err


# -- tables: one figure per cell --------------------------------------------------------------


def _human(argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("COLUMNS", "160")   # rich's width: no header wrapped across lines
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert not set("{}[]'") & set(out), out   # no dict or list dumped into a cell
    return out


def test_codec_tables(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    kv = _tiny_kv(tmp_path / "tiny.safetensors")
    out = _human(["bench", "codec", "--kv", str(kv), "--page-tokens", "8", "--runs", "1"], capsys, monkeypatch)
    for title in ("compressed / original", "compress GB/s", "decompress GB/s"):
        assert title in out
    head_to_head = importlib.util.find_spec("zipnn") is not None   # zipnn decodes BF16 and FP16 only
    assert ("head to head" in out) == head_to_head
    for row in ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2"):
        assert out.count(f" {row} ") == 3 + (head_to_head and row in ("bf16", "fp16"))


def test_codec_store_table(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                           monkeypatch: pytest.MonkeyPatch) -> None:
    kv = _tiny_kv(tmp_path / "tiny.safetensors")
    out = _human(["bench", "codec-store", "--kv", str(kv), "--page-tokens", "8", "--quick", "--dir", str(tmp_path)],
                 capsys, monkeypatch)
    for word in ("codec none vs lossless", "put GB/s", "pages in 16 slots", "lossless / none"):
        assert word in out


def test_net_tables(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import tierkv.bench.net as net

    cases = ("fetch-1", "fetch-batch", "incast-credits", "incast-no-credits")
    results = [net.NetBenchResult("tcp", c, 300.0 + i, 900.0, 2000.0 * (i + 1), 0.1, 0, i, 0)
               for i, c in enumerate(cases)]
    monkeypatch.setattr(net, "bench_local", lambda **kw: results)
    out = _human(["bench", "net", "--quick"], capsys, monkeypatch)
    assert "peer page fetches" in out and "p99 µs" in out and "incast-no-credits" in out
    assert "tcp batch vs single fetch throughput" in out and "2.00" in out


def test_store_tables(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The headline ratios in one table, the per-shape figures in tables with columns (the
    store suite's own measurements are exercised by tests/cli/test_replay_cli.py and the rig)."""
    import tierkv.bench.headline as headline

    dram = {"dram_put_gbps": 8.4, "dram_get_gbps": 4.4, "memcpy_gbps": 4.7, "tier_scattered_put_gbps": 6.25,
            "tier_scattered_get_gbps": 5.5}
    nvme = {"nvme_write_gbps": 2.3, "fio_write_gbps": 2.1, "nvme_read_gbps": 0.97, "fio_read_gbps": 0.78,
            "nvme_write_unaligned_gbps": 2.1, "nvme_read_unaligned_gbps": 1.0, "nvme_write_vs_fio": 1.08,
            "nvme_read_vs_fio": 1.25, "nvme_write_unaligned_vs_fio": 1.02, "nvme_read_unaligned_vs_fio": 1.29,
            "nvme_write_huge_gbps": 2.6, "nvme_read_huge_gbps": 1.7, "nvme_write_huge_vs_fio": 1.24,
            "nvme_read_huge_vs_fio": 2.18, "nvme_write_pool_gbps": 2.5, "nvme_read_pool_gbps": 1.6,
            "nvme_write_pool_vs_fio": 1.19, "nvme_read_pool_vs_fio": 2.05,
            "io_threads": 4, "fio_queue_depth": {"write": 16, "read": 16}, "verified": True,
            "spread_gbps": {"nvme_write": [2.1, 2.3]}, "io_threads_sweep": {"4": {"write_gbps": 2.4}}}
    keys = {"prompt_tokens": 131072, "tierkv_keys_ms": 0.2, "tierkv_lookup_ms": 0.1, "tierkv_ms": 0.3,
            "store_lookup_ms": 0.16, "sha256_keys_ms": 4.3, "sha256_lookup_ms": 0.58, "sha256_ms": 4.9,
            "native": True, "keys_vs_sha256": 30.9}
    result = {"dram_put_vs_memcpy": 1.78, "dram_get_vs_memcpy": 0.92, "nvme_read_vs_fio": 1.25,
              "nvme_write_vs_fio": 1.08, "keys_vs_sha256": 30.9, "runs": 3, "keys": keys,
              "shapes": [{"page_bytes": 1 << 20, "pages": 32, "dram": dram, "nvme": nvme},
                         {"page_bytes": 256 << 10, "pages": 512, "dram": dram, "nvme": nvme}]}
    monkeypatch.setattr(headline, "run", lambda args: result)
    out = _human(["bench", "store"], capsys, monkeypatch)
    assert "headline ratios" in out and "DRAM tier put" in out and "1.78" in out and "30.9" in out
    assert "scattered slots" in out and "6.25" in out
    assert "NVMe tier vs fio: 1.0 MiB pages x 32" in out and "NVMe tier vs fio: 256.0 KiB pages x 512" in out
    assert "chained sha256 + dict" in out and "4.90" in out
    assert "read, buffers on huge pages" in out and "2.18" in out
    assert "write from DRAM slots" in out and "1.19" in out
