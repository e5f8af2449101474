"""Corruption: flipped bytes in the NVMe data file and in the LMDB index, truncated
files, and a data file swapped with another store's. Each is detected by checksums,
seals or labels; the damaged page (or, for a foreign file, the store's pages) becomes a
miss with a logged reason, and every page still served has exactly its written bytes.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import PB, make_config, page_data
from tierkv.errors import ConfigError
from tierkv.store.api import Store
from tierkv.store.checksum import checksum64
from tierkv.store.opening import LABEL_BYTES
from tierkv.config import StoreConfig
from tierkv.keys import PageKey

N = 12  # prompts of 2 pages, all on the NVMe tier (no DRAM)


def prompt(i: int) -> np.ndarray:
    return np.arange(32, dtype=np.int64) + 10_000 * (i + 1)


def fill(cfg: StoreConfig, seed: int = 0) -> None:
    with Store.open(cfg) as s:
        for i in range(N):
            s.put(prompt(i), page_data(seed * 1000 + i, 2))


def served(cfg: StoreConfig, seed: int = 0) -> list[int]:
    """Pages served per prompt; fails the test on any wrong byte."""
    counts = []
    with Store.open(cfg) as s:
        for i in range(N):
            out = np.zeros((2, PB), dtype=np.uint8)
            n = s.get(prompt(i), out).pages
            assert np.array_equal(out[:n], page_data(seed * 1000 + i, 2)[:n]), f"prompt {i}: wrong bytes"
            counts.append(n)
    return counts


@pytest.fixture
def cfg(tmp_path: Path) -> StoreConfig:
    c = make_config(tmp_path / "s", 0, 2 * N)
    fill(c)
    return c


def test_flipped_data_bytes_quarantine_only_that_page(cfg: StoreConfig, caplog: pytest.LogCaptureFixture) -> None:
    data = Path(cfg.path) / "nvme.data"
    with open(data, "r+b") as f:  # slot 5 (the 6th page written: prompt 2, page 1)
        f.seek(LABEL_BYTES + 5 * PB + 1234)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    with caplog.at_level(logging.WARNING):
        counts = served(cfg)
    assert counts == [2, 2, 1] + [2] * (N - 3)
    assert "failed its checksum" in caplog.text
    # Both values in hex (issue 28 item 11: the stored one was printed in decimal).
    want = f"{checksum64(page_data(2, 2)[1]):x}"
    assert f"(stored {want}, read " in caplog.text
    assert served(cfg) == counts  # the quarantined page stays a miss; nothing else changed


@pytest.mark.parametrize("flips", [8, 200])
def test_random_flips_anywhere_in_the_index_never_give_wrong_bytes(cfg: StoreConfig, flips: int, soak: bool,
                                                                  tmp_path: Path) -> None:
    """Flip random bits of the LMDB file; every open must succeed (quarantining the index
    if LMDB finds it damaged) and serve only correct bytes. 20 trials, 400 with --soak."""
    pristine = tmp_path / "pristine"
    shutil.copytree(cfg.path, pristine)
    for seed in range(400 if soak else 20):
        shutil.rmtree(cfg.path)
        shutil.copytree(pristine, cfg.path)
        mdb = Path(cfg.path) / "index.lmdb" / "data.mdb"
        raw = bytearray(mdb.read_bytes())
        rng = random.Random(seed * 7919 + flips)
        for _ in range(flips):
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        mdb.write_bytes(bytes(raw))
        counts = served(cfg)  # opens, perhaps quarantining the index; asserts bytes
        assert all(0 <= c <= 2 for c in counts), (seed, counts)


def test_flipped_record_bytes_are_caught_by_the_seal(cfg: StoreConfig, caplog: pytest.LogCaptureFixture) -> None:
    mdb = Path(cfg.path) / "index.lmdb" / "data.mdb"
    raw = bytearray(mdb.read_bytes())
    with Store.open(cfg) as s:  # find one record's value bytes in the file: its checksum field
        entry = s._manager.entry(s._manager.locate(_first_key(s)).key)  # type: ignore[union-attr]
        assert entry is not None and entry.checksum is not None
        needle = entry.checksum.to_bytes(8, "little")
    hits = [i for i in range(len(raw) - 7) if raw[i:i + 8] == needle]
    assert hits  # LMDB copies pages on write: stale copies may hold the record too
    for at in hits:
        raw[at] ^= 0xFF
    mdb.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING):
        counts = served(cfg)
    # Prompt 0's first page is gone, so is its prefix; its record is in a run (one per commit
    # or group-commit window), which fails its seal: it and the runs before it are dropped.
    lost = counts.index(2) if 2 in counts else N
    assert lost >= 1 and counts == [0] * lost + [2] * (N - lost)
    assert "fails its seal" in caplog.text or "fail validation" in caplog.text


def _first_key(store: Store) -> PageKey:
    blob = store._keys(prompt(0), "")
    return PageKey(blob[:16])


def test_truncated_data_file_serves_the_head(cfg: StoreConfig, caplog: pytest.LogCaptureFixture) -> None:
    data = Path(cfg.path) / "nvme.data"
    os.truncate(data, LABEL_BYTES + 7 * PB + 99)
    with caplog.at_level(logging.WARNING):
        counts = served(cfg)
    assert counts[:3] == [2, 2, 2] and counts[3] == 1 and sum(counts[4:]) == 0
    assert "truncated" in caplog.text


def test_truncated_index_is_moved_aside(cfg: StoreConfig, caplog: pytest.LogCaptureFixture) -> None:
    mdb = Path(cfg.path) / "index.lmdb" / "data.mdb"
    os.truncate(mdb, 4096)
    with caplog.at_level(logging.ERROR):
        counts = served(cfg)
    assert counts == [0] * N
    assert any(p.name.startswith("index.lmdb.corrupt-") for p in Path(cfg.path).iterdir())
    fill(cfg, seed=3)  # the store works again afterwards
    assert served(cfg, seed=3) == [2] * N


def test_data_file_of_another_store_is_refused(tmp_path: Path, cfg: StoreConfig,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """Issue 28 item 1: it was relabelled (the other store's data taken over); now the open
    is refused with the file unchanged until it is handed over with tierkv format."""
    from tierkv.store.medium import format_medium
    other = make_config(tmp_path / "other", 0, 2 * N)
    fill(other, seed=7)  # same geometry, same keys, different bytes
    data = Path(cfg.path) / "nvme.data"
    shutil.copy(Path(other.path) / "nvme.data", data)
    before = data.read_bytes()
    with pytest.raises(ConfigError, match=r"belongs to another tierkv store \(the store at .*other on host"):
        Store.open(cfg)
    assert data.read_bytes() == before
    format_medium(data)                    # handed over
    with caplog.at_level(logging.WARNING):
        assert served(cfg) == [0] * N  # neither store's bytes are served as this store's
    assert "carries no label of this store (formatted)" in caplog.text
    fill(cfg, seed=0)
    assert served(cfg) == [2] * N
    assert served(other, seed=7) == [2] * N  # the other store is unharmed


def test_read_only_open_refuses_a_foreign_file(tmp_path: Path, cfg: StoreConfig) -> None:
    from tierkv.errors import ConfigError
    other = make_config(tmp_path / "other", 0, 2 * N)
    fill(other, seed=7)
    shutil.copy(Path(other.path) / "nvme.data", Path(cfg.path) / "nvme.data")
    with pytest.raises(ConfigError, match="does not belong"):
        Store.open(cfg, read_only=True)


_CUT_OPEN = r"""
import sys
from dataclasses import replace
from pathlib import Path
from tests.conftest import make_config
from tierkv.errors import ConfigError
from tierkv.store.api import Store
cfg = make_config(Path(sys.argv[1]), 0, 24, verify_index=sys.argv[2])
try:
    with Store.open(cfg, read_only=sys.argv[3] == "ro") as s:
        print("opened", len(s._manager))
except ConfigError as exc:
    print("refused", exc)
"""


@pytest.mark.parametrize("mode,verify", [("ro", "always"), ("rw", "never"), ("rw", "unclean"), ("rw", "always")])
def test_a_truncated_index_faults_no_process_in_any_mode(cfg: StoreConfig, mode: str, verify: str) -> None:
    """Issue 28 item 5: LMDB maps data.mdb and trusts its header, so a file cut short killed
    read-only readers (which run no child check) and writers that skip it with SIGBUS."""
    mdb = Path(cfg.path) / "index.lmdb" / "data.mdb"
    os.truncate(mdb, mdb.stat().st_size // 2 // 4096 * 4096)
    proc = subprocess.run([sys.executable, "-c", _CUT_OPEN, cfg.path, verify, mode], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[2], check=False)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    if mode == "ro":
        assert proc.stdout.startswith("refused") and "truncated" in proc.stdout
    else:  # the index is set aside and the store starts empty
        assert proc.stdout.split() == ["opened", "0"]
        assert any(p.name.startswith("index.lmdb.corrupt-") for p in Path(cfg.path).iterdir())


def test_a_read_only_store_reports_unverified_pages_in_bulk_and_quarantines_nothing(
        cfg: StoreConfig, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 28 item 11: readers logged "quarantined", once per page, for pages they cannot
    quarantine (about 1,300 lines in 24 s beside a busy writer)."""
    data = Path(cfg.path) / "nvme.data"
    with open(data, "r+b") as f:  # every page damaged
        for slot in range(2 * N):
            f.seek(LABEL_BYTES + slot * PB + 7)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x01]))
    with caplog.at_level(logging.WARNING), Store.open(cfg, read_only=True) as reader:
        out = np.zeros((2, PB), dtype=np.uint8)
        for _ in range(10):
            for i in range(N):
                assert reader.get(prompt(i), out).pages == 0
        assert reader.stats().corrupt_pages == 10 * N
    warnings = [r for r in caplog.records if "failed verification" in r.getMessage()]
    assert len(warnings) == 1 and "quarantined" not in caplog.text
    assert served(cfg) == [0] * N   # the writer quarantines them when it reads them


def test_a_directory_where_the_clean_marker_goes_is_named(cfg: StoreConfig) -> None:
    """Issue 28 item 7: it was taken as a clean close, then the open died with IsADirectoryError."""
    marker = Path(cfg.path) / "clean"
    marker.unlink()
    marker.mkdir()
    with pytest.raises(ConfigError, match=r"clean is a directory; the store keeps its clean-shutdown marker"):
        Store.open(cfg)
    marker.rmdir()
    assert served(cfg) == [2] * N


@pytest.mark.parametrize("err,damaged", [(errno.EACCES, False), (errno.EMFILE, False), (errno.EIO, True)])
def test_an_index_that_cannot_be_read_is_set_aside_only_when_the_medium_fails(
        cfg: StoreConfig, monkeypatch: pytest.MonkeyPatch, err: int, damaged: bool) -> None:
    """Found in review: the length check set the index aside on any OSError (a permission
    error lost every durable page); only EIO says the file itself is bad."""
    from tierkv.store import index_check

    real_open = open

    def failing(path: object, *args: object, **kw: object) -> object:
        if str(path).endswith("data.mdb"):
            raise OSError(err, os.strerror(err), str(path))
        return real_open(path, *args, **kw)  # type: ignore[call-overload]

    monkeypatch.setattr(index_check, "open", failing, raising=False)
    never = replace(cfg, verify_index="never")
    if damaged:
        with Store.open(never) as s:
            assert len(s._manager) == 0        # set aside: the store starts empty
        assert any(p.name.startswith("index.lmdb.corrupt-") for p in Path(cfg.path).iterdir())
        return
    with pytest.raises(ConfigError, match="cannot read the store index"):
        Store.open(never)
    monkeypatch.undo()
    assert not any(p.name.startswith("index.lmdb.corrupt-") for p in Path(cfg.path).iterdir())
    assert served(cfg) == [2] * N              # every page still there


def test_the_child_walk_gets_more_time_for_a_larger_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in review: a fixed 120 s deadline set aside healthy indexes of some 80M+ records
    (the walk timed out), so it grows with the file."""
    from tierkv.store import index_check

    seen: list[float] = []

    class Child:   # each child checker, answering at once; the time it is given is kept
        returncode = 0

        def __init__(self, cmd: list[str], **kw: object) -> None:
            pass

        def communicate(self, timeout: float | None = None) -> tuple[str, str]:
            assert timeout is not None
            seen.append(timeout)
            return "0\n", ""

        def poll(self) -> int:
            return 0

    monkeypatch.setattr(index_check.subprocess, "Popen", Child)
    (tmp_path / "data.mdb").touch()
    os.truncate(tmp_path / "data.mdb", 50 * 10**9)      # sparse: a 50 GB index
    assert index_check.probe_index(tmp_path, seals=True) == (None, 0)
    want = 120.0 + 50 * 10**9 / index_check.PROBE_BYTES_PER_S
    assert seen and all(want - 5 < t <= want for t in seen)


@pytest.mark.parametrize("cpus", [1, 2])
def test_the_child_checkers_count_every_unsealed_record_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             cpus: int) -> None:
    """With two CPUs the seals are checked by two children, a half of the keys each (split
    at 0x80), beside a third that rehearses the writes; with one, one child does all. Bad
    seals on both sides of the split, at its edges and in a small database are each counted
    once; a healthy index passes."""
    import lmdb
    import xxhash

    from tierkv.store import index_check

    monkeypatch.setattr(index_check, "_cpus", lambda: cpus)
    env = lmdb.open(str(tmp_path), max_dbs=4, map_size=1 << 28)
    pages, meta = env.open_db(b"pages"), env.open_db(b"meta")
    rng = np.random.default_rng(7)
    keys = [bytes(k) for k in rng.integers(0, 256, size=(5000, 16), dtype=np.uint8)]
    keys += [b"\x7f" + b"\xff" * 15, b"\x80" + b"\x00" * 15, b"\x00" * 16, b"\xff" * 16]
    bad = {keys[0], keys[1], keys[-4], keys[-3], keys[-2], keys[-1]}
    bad |= {k for k in keys[2:200] if k[0] >= 0x80}
    with env.begin(write=True) as txn:
        for k in keys:
            body = rng.integers(0, 256, size=40, dtype=np.uint8).tobytes()
            seal = xxhash.xxh3_64_intdigest(k + body) ^ (k in bad)
            txn.put(k, body + seal.to_bytes(8, "little"), db=pages)
        txn.put(b"layout", b"{}" + (xxhash.xxh3_64_intdigest(b"layout{}") ^ 1).to_bytes(8, "little"), db=meta)
    env.close()
    assert any(k[0] < 0x80 for k in bad) and any(k[0] >= 0x80 for k in bad)
    assert index_check.probe_index(tmp_path, seals=True) == (None, len(bad) + 1)
    assert index_check.probe_index(tmp_path, seals=False) == (None, 0)   # a walk counts nothing
    with open(tmp_path / "data.mdb", "r+b") as f:   # cut short: every child refuses it
        f.truncate(os.path.getsize(tmp_path / "data.mdb") // 2)
    why, _ = index_check.probe_index(tmp_path, seals=True)
    assert why is not None
