"""``tierkv format``: it shows what is on a file or device, changes nothing without --yes
(or a yes typed at a terminal), refuses one in use, and after formatting a store takes
the medium (issue 28 item 1)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from tests.conftest import PB, make_config
from tierkv.cli.exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from tierkv.cli.main import main
from tierkv.config import NvmeConfig, StoreConfig
from tierkv.errors import ConfigError
from tierkv.store.api import Store
from tierkv.store.medium import FORMAT_MAGIC, LABEL_MAGIC, TAIL_BYTES

PAGES = 16
TEXT = b"root:x:0:0:root:/root:/bin/bash\n" * 50


def _tool(name: str) -> str:
    exe = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
    if exe is None:
        pytest.skip(f"needs {name}")
    return exe


def _sha(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _cfg(store_dir: Path, data: Path) -> StoreConfig:
    return replace(make_config(store_dir, 0, PAGES), nvme=NvmeConfig(PAGES * PB, path=str(data)))


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, object]]:
    code = main(["format", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_without_yes_it_only_reports_and_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "passwd"
    data.write_bytes(TEXT)
    before = _sha(data)
    code, out = _run(capsys, str(data))
    assert code == EXIT_FAILED and _sha(data) == before
    assert out["kind"] == "regular file" and out["size_bytes"] == len(TEXT) and out["nonzero"] is True
    assert out["contents"] == "foreign" and out["formatted"] is False and out["store_may_take"] is False
    assert main(["format", str(data)]) == EXIT_FAILED                    # the summary says the same
    assert "a store refuses it" in capsys.readouterr().out and _sha(data) == before


def test_yes_formats_and_a_store_then_takes_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pages = 256                                                      # a 4 MiB + 4 KiB tier
    size = 4096 + pages * PB
    data = tmp_path / "disk.img"
    data.write_bytes(TEXT)                                           # data at both ends and in the middle
    with open(data, "r+b") as f:
        f.truncate(size)
        f.seek(2 << 20)
        f.write(TEXT)
        f.seek(size - len(TEXT))
        f.write(TEXT)
    cfg = replace(_cfg(tmp_path / "s", data), nvme=NvmeConfig(pages * PB, path=str(data)))
    with pytest.raises(ConfigError, match="holds data that is not this store's"):
        Store.open(cfg)
    code, out = _run(capsys, str(data), "--yes")
    assert code == EXIT_OK and out["formatted"] is True and out["store_may_take"] is True
    assert out["erased"] == [[0, TAIL_BYTES], [size - TAIL_BYTES, TAIL_BYTES]]
    raw = data.read_bytes()
    assert len(raw) == size and raw.startswith(FORMAT_MAGIC)
    assert raw.count(0) == size - len(FORMAT_MAGIC) - len(TEXT) and raw[2 << 20:].startswith(TEXT)  # the rest kept
    code, out = _run(capsys, str(data))
    assert code == EXIT_OK and out["contents"] == "formatted"
    with Store.open(cfg):
        pass
    assert data.read_bytes().startswith(LABEL_MAGIC)


def test_an_ext4_image_shows_its_signatures_and_loses_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "fs.img"
    data.touch()
    os.truncate(data, 4 << 20)
    subprocess.run([_tool("mkfs.ext4"), "-q", "-F", str(data)], check=True, capture_output=True)
    code, out = _run(capsys, str(data))
    assert code == EXIT_FAILED and out["blkid"] == "found"
    signatures = out["signatures"]
    assert isinstance(signatures, list) and "ext2/3/4 superblock" in signatures
    assert any("TYPE=ext4" in s for s in signatures)
    assert _run(capsys, str(data), "--yes")[0] == EXIT_OK
    probe = subprocess.run([_tool("blkid"), "-p", "-o", "export", str(data)], capture_output=True, text=True)
    assert probe.returncode == 2, probe.stdout                       # no signature left


def test_a_store_label_names_its_owner_and_a_file_in_use_is_refused(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "a.data"
    cfg = _cfg(tmp_path / "a", data)
    with Store.open(cfg):
        before = _sha(data)
        assert main(["format", str(data), "--yes"]) == EXIT_FAILED    # its writer holds the lock
        assert "in use by a tierkv store's writer" in capsys.readouterr().err
        assert _sha(data) == before
    code, out = _run(capsys, str(data))
    label = out["tierkv_label"]
    assert code == EXIT_FAILED and out["contents"] == "tierkv" and isinstance(label, dict)
    assert label["path"] == os.path.realpath(cfg.path) and len(str(label["identity"])) == 32
    assert main(["format", str(data)]) == EXIT_FAILED
    assert "the store that labelled it reopens it" in capsys.readouterr().out


@pytest.mark.parametrize("answer,code", [("yes\n", EXIT_OK), ("no\n", EXIT_FAILED)])
def test_at_a_terminal_it_asks(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                               answer: str, code: int) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    data = tmp_path / "passwd"
    data.write_bytes(TEXT)
    monkeypatch.setattr("sys.stdin", Tty(answer))
    assert main(["format", str(data)]) == code
    assert "Type yes" in capsys.readouterr().err
    assert data.read_bytes().startswith(FORMAT_MAGIC) == (code == EXIT_OK)


def test_nothing_to_format_and_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _run(capsys, str(tmp_path / "new.data"), "--yes")
    assert code == EXIT_OK and out["contents"] == "missing" and out["formatted"] is False
    assert not (tmp_path / "new.data").exists()
    assert main(["format", str(tmp_path)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "is a directory" in err and err.count("\n") == 1


@pytest.fixture
def loop(tmp_path: Path) -> Iterator[Path]:
    """A loop device over a 4 MiB file; skipped where one cannot be attached."""
    backing = tmp_path / "dev.img"
    backing.write_bytes(TEXT)
    os.truncate(backing, 4 << 20)
    if os.geteuid() != 0:
        pytest.skip("needs root for a loop device")
    res = subprocess.run([_tool("losetup"), "-f", "--show", str(backing)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"no loop device here: {res.stderr.strip()}")
    node = Path(res.stdout.strip())
    try:
        yield node
    finally:
        subprocess.run([_tool("losetup"), "-d", str(node)], check=False)


def test_a_device_held_exclusively_is_refused_then_formatted(loop: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _run(capsys, str(loop))
    assert code == EXIT_FAILED and out["kind"] == "block device" and out["size_bytes"] == 4 << 20
    held = os.open(loop, os.O_RDONLY | os.O_EXCL)                  # as a mount holds it
    try:
        assert main(["format", str(loop), "--yes"]) == EXIT_FAILED
        assert "is in use (mounted" in capsys.readouterr().err
    finally:
        os.close(held)
    code, out = _run(capsys, str(loop), "--yes")
    assert code == EXIT_OK and out["formatted"] is True
