"""Issue 28 item 2: two stores naming one data file. The writer holds an exclusive lock on
its NVMe file while open, so a second store is refused instead of relabelling the file
(which turned the first store's pages into misses)."""

from __future__ import annotations

import subprocess
from dataclasses import replace
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import LAYOUT, PB, make_config, page_data
from tierkv.config import NvmeConfig, StoreConfig
from tierkv.errors import StoreBusyError
from tierkv.store.api import Store

TOKENS = np.arange(4 * LAYOUT.tokens_per_page, dtype=np.uint32)


def _config(store_dir: Path, data: Path) -> StoreConfig:
    return replace(make_config(store_dir), nvme=NvmeConfig(16 * PB, path=str(data)))


def test_a_second_store_on_the_same_data_file_is_refused_while_the_first_is_open(tmp_path: Path) -> None:
    data = tmp_path / "shared.data"
    with Store.open(_config(tmp_path / "a", data)) as a:
        a.put(TOKENS, page_data(1, 4))
        a.flush()
        with pytest.raises(StoreBusyError, match=r"shared\.data is in use by another store's writer"):
            Store.open(_config(tmp_path / "b", data))
        out = np.empty((4, PB), dtype=np.uint8)
        assert a.get(TOKENS, out).pages == 4 and np.array_equal(out, page_data(1, 4))
    with Store.open(_config(tmp_path / "a", data)) as again:   # the lock went with it
        assert again.lookup(TOKENS).cached_pages == 4


def test_a_store_in_another_process_is_refused_too(tmp_path: Path) -> None:
    data = tmp_path / "shared.data"
    with Store.open(_config(tmp_path / "a", data)):
        code = ("import sys; from pathlib import Path; from tests.reliability.test_shared_data_file import _config; "
                "from tierkv.store.api import Store; from tierkv.errors import StoreBusyError\n"
                "try:\n    Store.open(_config(Path(sys.argv[1]), Path(sys.argv[2])))\n"
                "except StoreBusyError as e:\n    print('busy', e); sys.exit(3)\n")
        proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "b"), str(data)], capture_output=True,
                              text=True, timeout=120, cwd=Path(__file__).resolve().parents[2], check=False)
        assert proc.returncode == 3, proc.stderr[-2000:]
        assert "in use by another store's writer" in proc.stdout


def test_read_only_readers_share_the_file_with_the_writer(tmp_path: Path) -> None:
    data = tmp_path / "shared.data"
    with Store.open(_config(tmp_path / "a", data)) as a:
        a.put(TOKENS, page_data(2, 4))
        a.flush()
        with Store.open(_config(tmp_path / "a", data), read_only=True) as reader:
            assert reader.lookup(TOKENS).cached_pages >= 0   # opens: a reader takes no lock
