"""Issue 28 item 1: a store never takes over data that is not its own.

An existing file or device named as ``[tiers.nvme] path`` was taken over: a shorter
regular file was grown and its first 4 KiB overwritten with the store's label, a block
device holding ext4 was labelled without a word (afterwards blkid found no signature and
e2fsck a bad superblock). Now each is refused with a one-line ConfigError naming the path,
what is there and how to allow it, and left byte for byte as it was; ``format = true`` (or
``tierkv format``) lets the store take it. A store's own file, a truncated own file and an
earlier store's file in the same directory (its index lost) still open.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import PB, make_config, page_data
from tierkv.config import NvmeConfig, StoreConfig
from tierkv.errors import ConfigError
from tierkv.store import medium
from tierkv.store.api import Store
from tierkv.store.medium import LABEL_BYTES, Contents, examine, format_medium

PAGES = 128
TIER_BYTES = LABEL_BYTES + PAGES * PB     # 2 MiB + 4 KiB
TOKENS = np.arange(64, dtype=np.int64)    # 4 pages
PASSWD = b"root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n" * 20


def _tool(name: str) -> str:
    exe = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
    if exe is None:
        pytest.skip(f"needs {name} (e2fsprogs / util-linux)")
    return exe


def _sha(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _cfg(tmp_path: Path, data: Path, fmt: bool = False) -> StoreConfig:
    return replace(make_config(tmp_path / "store", 0, PAGES), nvme=NvmeConfig(PAGES * PB, path=str(data), format=fmt))


def _ext4(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        f.truncate(size)
    subprocess.run([_tool("mkfs.ext4"), "-q", "-F", str(path)], check=True, capture_output=True)


def _mbr(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        f.truncate(size)
        f.seek(446)
        f.write(bytes([0x80, 0, 2, 0, 0x83, 0, 0, 0, 1, 0, 0, 0, 0, 8, 0, 0]))  # one Linux partition
        f.seek(510)
        f.write(b"\x55\xaa")


def _refused(cfg: StoreConfig, data: Path, *found: str) -> str:
    """Open ``cfg``: refused with one line naming ``data``, what was ``found`` and how to allow it;
    the file unchanged and no index left behind."""
    before = _sha(data), data.stat().st_size
    with pytest.raises(ConfigError) as err:
        Store.open(cfg)
    msg = str(err.value)
    assert "\n" not in msg and str(data) in msg, msg
    assert "holds data that is not this store's" in msg and f"tierkv format {data}" in msg, msg
    assert "format = true in [tiers.nvme]" in msg, msg
    for what in found:
        assert what in msg, msg
    assert (_sha(data), data.stat().st_size) == before
    assert not (Path(cfg.path) / "index.lmdb").exists()
    return msg


def _taken(cfg: StoreConfig, data: Path) -> None:
    with Store.open(cfg) as s:
        assert s.put(TOKENS, page_data(1, 4)).stored == 4
    with Store.open(replace(cfg, nvme=replace(cfg.nvme, format=False))) as s:  # type: ignore[type-var]
        out = np.zeros((4, PB), dtype=np.uint8)
        assert s.get(TOKENS, out).pages == 4 and np.array_equal(out, page_data(1, 4))
    with open(data, "rb") as f:
        assert f.read(len(medium.LABEL_MAGIC)) == medium.LABEL_MAGIC


def test_a_text_file_like_etc_passwd_is_refused_and_taken_only_with_format(tmp_path: Path) -> None:
    data = tmp_path / "passwd"
    data.write_bytes(PASSWD)                       # shorter than the tier: it used to be grown and labelled
    _refused(_cfg(tmp_path, data), data, f"a regular file of {len(PASSWD)} bytes: non-zero bytes")
    with pytest.raises(ConfigError, match="does not belong"):   # a reader changes nothing either
        Store.open(_cfg(tmp_path, data), read_only=True)
    assert data.read_bytes() == PASSWD
    _taken(_cfg(tmp_path, data, fmt=True), data)
    assert data.stat().st_size == TIER_BYTES


@pytest.mark.parametrize("size", [1 << 20, TIER_BYTES, 4 << 20], ids=["shorter", "exact", "larger"])
def test_an_ext4_image_is_refused_whatever_its_size(tmp_path: Path, size: int) -> None:
    data = tmp_path / "fs.img"
    _ext4(data, size)
    _refused(_cfg(tmp_path, data), data, "ext2/3/4 superblock", "blkid: TYPE=ext4")
    subprocess.run([_tool("e2fsck"), "-fn", str(data)], check=True, capture_output=True)
    if size <= TIER_BYTES:   # a larger file is refused by its size even then
        _taken(_cfg(tmp_path, data, fmt=True), data)


def test_an_mbr_signed_file_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "disk.img"
    _mbr(data, TIER_BYTES)
    _refused(_cfg(tmp_path, data), data, "MBR boot signature")
    _taken(_cfg(tmp_path, data, fmt=True), data)


def test_without_blkid_our_own_checks_still_refuse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "fs.img"
    _ext4(data, TIER_BYTES)
    empty = tmp_path / "nobin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setattr(medium, "_SBIN", str(empty))
    found = examine(data)
    assert found.blkid == "not installed" and found.contents is Contents.FOREIGN
    assert "ext2/3/4 superblock" in found.signatures
    _refused(_cfg(tmp_path, data), data, "ext2/3/4 superblock")


def test_a_sparse_blank_file_an_empty_one_and_a_formatted_one_are_taken(tmp_path: Path) -> None:
    for name, make in (("sparse", lambda p: os.truncate(p, TIER_BYTES)), ("empty", lambda p: None)):
        data = tmp_path / f"{name}.data"
        data.touch()
        make(data)             # a file the store made and did not label yet (a crash), or a new empty one
        _taken(_cfg(tmp_path / name, data), data)
    data = tmp_path / "passwd"
    data.write_bytes(PASSWD)
    assert format_medium(data) == ((0, len(PASSWD)),)
    assert examine(data).contents is Contents.FORMATTED
    _taken(_cfg(tmp_path / "f", data), data)


def test_another_stores_data_file_is_refused_even_with_format(tmp_path: Path) -> None:
    data = tmp_path / "a.data"
    _taken(_cfg(tmp_path / "a", data), data)
    before = _sha(data)
    with pytest.raises(ConfigError, match=r"belongs to another tierkv store .*tierkv format .* --yes"):
        Store.open(_cfg(tmp_path / "b", data, fmt=True))
    assert _sha(data) == before
    format_medium(data)
    _taken(_cfg(tmp_path / "b", data), data)


def test_own_file_truncated_and_an_earlier_store_of_this_directory_still_open(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data = tmp_path / "own.data"
    cfg = _cfg(tmp_path, data)
    _taken(cfg, data)
    os.truncate(data, LABEL_BYTES + 2 * PB)          # own file, truncated: grown back
    out = np.zeros((4, PB), dtype=np.uint8)
    with caplog.at_level(logging.WARNING), Store.open(cfg) as s:
        assert s.get(TOKENS, out).pages == 2 and np.array_equal(out[:2], page_data(1, 2))
    assert "truncated" in caplog.text and data.stat().st_size == TIER_BYTES
    shutil.rmtree(Path(cfg.path) / "index.lmdb")      # its index lost: the same directory takes its file back
    caplog.clear()
    with caplog.at_level(logging.WARNING), Store.open(cfg) as s:
        assert s.get(TOKENS, out).pages == 0
    assert "carries the label of an earlier store" in caplog.text
    _taken(cfg, data)


# -- block devices: a loop device over an image -----------------------------------------

@pytest.fixture
def loop(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(a loop device, its backing file); skipped where loop devices cannot be attached."""
    backing = tmp_path / "dev.img"
    backing.touch()
    os.truncate(backing, 4 << 20)
    if os.geteuid() != 0:
        pytest.skip("needs root for a loop device")
    res = subprocess.run([_tool("losetup"), "-f", "--show", str(backing)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"no loop device here: {res.stderr.strip()}")
    node = Path(res.stdout.strip())
    try:
        yield node, backing
    finally:
        subprocess.run([_tool("losetup"), "-d", str(node)], check=False)


def test_an_ext4_block_device_is_refused_and_keeps_its_filesystem(tmp_path: Path, loop: tuple[Path, Path]) -> None:
    node, _ = loop
    subprocess.run([_tool("mkfs.ext4"), "-q", "-F", str(node)], check=True, capture_output=True)
    _refused(_cfg(tmp_path, node), node, "a block device of", "blkid: TYPE=ext4")
    blkid = subprocess.run([_tool("blkid"), "-p", "-o", "export", str(node)], capture_output=True, text=True)
    assert "TYPE=ext4" in blkid.stdout
    subprocess.run([_tool("e2fsck"), "-fn", str(node)], check=True, capture_output=True)
    _taken(_cfg(tmp_path, node, fmt=True), node)


def test_a_blank_block_device_is_labelled(tmp_path: Path, loop: tuple[Path, Path]) -> None:
    node, _ = loop
    _taken(_cfg(tmp_path, node), node)
