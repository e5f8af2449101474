"""``tierkv bench`` on bad input: a file that is not safetensors, a ``--dir`` that is not a
directory. Each is one ``tierkv: error: ...`` line and exit status 2, before any measuring."""

from __future__ import annotations

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
