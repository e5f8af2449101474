"""A store over an NVMe-oF tier losing its namespace: misses while degraded, nothing wrong,
nothing durable lost, full service after recovery and after a restart.

The namespace is a file named by ``[tiers.nvmeof] device`` (a StaticLink): moving the
file away is a real loss the tier's monitor sees. tests/rig runs the same scenario
against the kernel's NVMe-oF target over soft-RoCE.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import LAYOUT, PB, page_data
from tests.nvmeof.test_sysfs import HOSTNQN, add_controller
from tests.polling import wait_for
from tierkv.store.api import Store
from tierkv.config import DramConfig, NvmeConfig, NvmeofConfig, StoreConfig
from tierkv.errors import ConfigError, TierIOError
from tierkv.store.opening import LABEL_BYTES, label_data_bytes
from tierkv.tiers.base import TierKind
from tierkv.tiers.fabric import FabricLink, open_nvmeof_tier

TPP = LAYOUT.tokens_per_page
SLOTS = 32


def prompt(seed: int, pages: int) -> np.ndarray:
    return np.random.default_rng(seed + 7000).integers(0, 50000, pages * TPP, dtype=np.int64)


def make(tmp_path: Path) -> tuple[StoreConfig, Path]:
    dev = tmp_path / "ns1.img"
    if not dev.exists():
        with open(dev, "wb") as f:
            f.truncate(LABEL_BYTES + SLOTS * PB)
    cfg = StoreConfig(path=str(tmp_path / "store"), model_id="m", layout=LAYOUT, dram=DramConfig(4 * PB),
                      nvmeof=NvmeofConfig(device=str(dev), io_timeout_s=2.0, monitor_interval_s=0.05))
    return cfg, dev


def load(store: Store, tokens: np.ndarray, n: int) -> tuple[int, np.ndarray]:
    out = np.zeros((n, PB), dtype=np.uint8)
    return store.get(tokens, out).pages, out


def state(store: Store) -> str:
    return store.stats().tiers["nvmeof"].state


def test_whole_namespace_is_the_default_capacity(tmp_path: Path) -> None:
    cfg, _ = make(tmp_path)
    with Store.open(cfg) as s:
        assert s.stats().tiers["nvmeof"].capacity_slots == SLOTS


def test_loss_turns_pages_into_misses_and_recovery_brings_them_back(tmp_path: Path) -> None:
    cfg, dev = make(tmp_path)
    prompts = [(prompt(i, 2), page_data(i, 2)) for i in range(6)]  # 12 pages, DRAM holds 4
    with Store.open(cfg) as s:
        for tokens, data in prompts:
            assert s.put(tokens, data).stored == 2
        first, first_data = prompts[0]
        assert s.lookup(first).tiers == (TierKind.NVMEOF,) * 2

        away = dev.with_suffix(".away")
        os.rename(dev, away)
        assert wait_for(lambda: state(s) == "degraded")
        assert s.lookup(first).cached_pages == 0
        n, out = load(s, first, 2)
        assert n == 0 and not out.any()
        # Stores still work: DRAM takes the pages, its victims are dropped, not demoted.
        new_tokens, new_data = prompt(50, 3), page_data(50, 3)
        assert s.put(new_tokens, new_data).stored == 3
        n, out = load(s, new_tokens, 3)
        assert n == 3 and np.array_equal(out, new_data)

        os.rename(away, dev)
        assert wait_for(lambda: state(s) == "available")
        n, out = load(s, first, 2)
        assert n == 2 and np.array_equal(out, first_data)

    with Store.open(cfg) as s:  # the index survived the episode and the restart
        for i, (tokens, data) in enumerate(prompts):
            n, out = load(s, tokens, 2)
            # Prompts 4 and 5 lived only in DRAM during the loss, so their victims were dropped.
            assert n == 2 if i < 4 else n <= 2
            assert np.array_equal(out[:n], data[:n])


def test_close_while_degraded_keeps_the_index(tmp_path: Path) -> None:
    cfg, dev = make(tmp_path)
    prompts = [(prompt(i, 2), page_data(i, 2)) for i in range(5)]
    s = Store.open(cfg)
    for tokens, data in prompts:
        s.put(tokens, data)
    s.flush()                                       # what was committed before the loss must survive it
    away = dev.with_suffix(".away")
    os.rename(dev, away)
    assert wait_for(lambda: state(s) == "degraded")
    s.close()  # no flush, no writeback possible: must neither hang nor drop the index
    os.rename(away, dev)
    with Store.open(cfg) as s:
        tokens, data = prompts[0]
        n, out = load(s, tokens, 2)
        assert n == 2 and np.array_equal(out, data)


# -- labels: whose namespace is it -------------------------------------------------------

def _two_stores(tmp_path: Path) -> tuple[StoreConfig, StoreConfig, list[tuple[np.ndarray, np.ndarray]]]:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, _ = make(tmp_path / "a")
    b, _ = make(tmp_path / "b")
    prompts = [(prompt(i, 2), page_data(i, 2)) for i in range(2)]
    for cfg in (a, b):
        with Store.open(cfg) as s:
            for tokens, data in prompts:
                assert s.put(tokens, data).stored == 2
    return a, b, prompts


def _served(cfg: StoreConfig, prompts: list[tuple[np.ndarray, np.ndarray]]) -> list[int]:
    with Store.open(cfg) as s:
        counts = []
        for tokens, data in prompts:
            n, out = load(s, tokens, 2)
            assert np.array_equal(out[:n], data[:n])
            counts.append(n)
        return counts


def test_a_namespace_labelled_by_another_store_is_refused(tmp_path: Path) -> None:
    a, b, prompts = _two_stores(tmp_path)
    assert a.nvmeof is not None and b.nvmeof is not None
    b_dev = Path(b.nvmeof.device or "")
    before = b_dev.read_bytes()[:LABEL_BYTES]
    # /dev names shifted: store A's config now names B's namespace
    wrong = dataclasses.replace(a, nvmeof=dataclasses.replace(a.nvmeof, device=str(b_dev)))
    with pytest.raises(ConfigError, match="belongs to another tierkv store") as err:
        Store.open(wrong)
    assert str(b_dev) in str(err.value) and "\n" not in str(err.value)
    assert b_dev.read_bytes()[:LABEL_BYTES] == before      # B's label untouched
    assert _served(b, prompts) == [2, 2]                   # B keeps every page
    assert _served(a, prompts) == [2, 2]                   # and A kept its index records


def test_a_refused_first_open_leaves_no_index_behind(tmp_path: Path) -> None:
    """A new store pointed at another store's namespace by mistake: once the config names
    its own namespace (of another size), it opens, with no geometry left from the mistake."""
    a, b, _ = _two_stores(tmp_path)
    assert a.nvmeof is not None and b.nvmeof is not None
    fresh = dataclasses.replace(a, path=str(tmp_path / "c"), nvmeof=dataclasses.replace(a.nvmeof, device=b.nvmeof.device))
    with pytest.raises(ConfigError, match="belongs to another tierkv store"):
        Store.open(fresh)
    own = tmp_path / "c.img"
    with open(own, "wb") as f:
        f.truncate(LABEL_BYTES + SLOTS // 2 * PB)
    with Store.open(dataclasses.replace(fresh, nvmeof=dataclasses.replace(a.nvmeof, device=str(own)))) as s:
        assert s.stats().tiers["nvmeof"].capacity_slots == SLOTS // 2


def test_a_blank_namespace_is_labelled_and_a_non_tierkv_one_needs_format(tmp_path: Path) -> None:
    """Issue 28 item 1: a namespace holding data that is not a store's was labelled."""
    cfg, dev = make(tmp_path)
    with Store.open(cfg) as s:                      # blank (all zeros): taken
        assert state(s) == "available"
    assert dev.read_bytes().startswith(b"tierkv-data-")
    (tmp_path / "x").mkdir()
    cfg, dev = make(tmp_path / "x")
    with open(dev, "r+b") as f:
        f.write(b"some filesystem superblock" * 10)
    before = dev.read_bytes()
    with pytest.raises(ConfigError, match=r"holds data that is not this store's .*format = true in \[tiers.nvmeof\]"):
        Store.open(cfg)
    assert dev.read_bytes() == before
    assert cfg.nvmeof is not None
    with Store.open(dataclasses.replace(cfg, nvmeof=dataclasses.replace(cfg.nvmeof, format=True))) as s:
        assert state(s) == "available"
    assert dev.read_bytes().startswith(b"tierkv-data-")


def test_a_store_whose_index_was_lost_takes_its_namespace_back(tmp_path: Path) -> None:
    cfg, dev = make(tmp_path)
    prompts = [(prompt(0, 2), page_data(0, 2))]
    with Store.open(cfg) as s:
        s.put(*prompts[0])
    shutil.rmtree(cfg.path)  # "it is a cache: remove the directory" (same path, new identity)
    assert _served(cfg, prompts) == [0]
    with Store.open(cfg) as s:
        assert s.put(*prompts[0]).stored == 2
    assert _served(cfg, prompts) == [2]


def test_another_store_with_the_same_host_and_path_is_refused(tmp_path: Path) -> None:
    """Two containers, one host name, one store path, two namespaces: when the device
    names swap, the second store's index (an identity of its own, not a lost one) must
    not take the first store's namespace as 'its earlier self'."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, a_dev = make(tmp_path / "a")
    _, b_dev = make(tmp_path / "b")
    prompts = [(prompt(i, 2), page_data(i, 2)) for i in range(2)]
    with Store.open(a) as s:                       # container A: its store at a.path, on namespace a_dev
        for tokens, data in prompts:
            s.put(tokens, data)
    parked = Path(a.path).with_name("parked")
    os.rename(a.path, parked)                      # A's directory leaves: "another container"
    b = dataclasses.replace(a, nvmeof=dataclasses.replace(a.nvmeof, device=str(b_dev)))  # same path
    with Store.open(b) as s:                       # container B: same host, same path, own namespace
        s.put(*prompts[0])
    before = a_dev.read_bytes()[:LABEL_BYTES]
    with pytest.raises(ConfigError, match="with another identity than this store's index") as err:
        Store.open(dataclasses.replace(b, nvmeof=dataclasses.replace(b.nvmeof, device=str(a_dev))))
    assert "\n" not in str(err.value)
    assert a_dev.read_bytes()[:LABEL_BYTES] == before     # A's label untouched
    shutil.rmtree(a.path)
    os.rename(parked, a.path)
    assert _served(a, prompts) == [2, 2]                   # and A keeps every page


def test_an_index_that_never_labelled_still_takes_its_namespace_back(tmp_path: Path) -> None:
    """The index is damaged (moved aside, a new one made) and, in that same open, the device
    names are swapped, so the open is refused before it labels anything. The new index
    has an identity but no namespace of its own yet: once the names are right again it
    takes its own namespace back instead of being refused for good."""
    a, b, prompts = _two_stores(tmp_path)
    assert a.nvmeof is not None and b.nvmeof is not None
    os.truncate(Path(a.path) / "index.lmdb" / "data.mdb", 4096)          # A's index is damaged
    with pytest.raises(ConfigError, match="belongs to another tierkv store"):
        Store.open(dataclasses.replace(a, nvmeof=dataclasses.replace(a.nvmeof, device=b.nvmeof.device)))
    assert _served(a, prompts) == [0, 0]      # opens on its own namespace (its pages went with the index)
    with Store.open(a) as s:
        assert s.put(*prompts[0]).stored == 2
    assert _served(b, prompts) == [2, 2]       # and B was never touched


def test_a_pre_owner_label_is_refused_by_an_index_with_a_namespace_of_its_own(tmp_path: Path) -> None:
    """A label from before owner records cannot say whose it is. A new index takes it (it
    is most likely this directory's earlier store); one that has labelled its own
    namespace already does not: it is another store's."""
    a, b, prompts = _two_stores(tmp_path)
    assert a.nvmeof is not None and b.nvmeof is not None
    b_dev = Path(b.nvmeof.device or "")
    with open(b_dev, "r+b") as f:   # B's label as written before owner records: magic + identity, zeros
        f.seek(32)
        f.write(b"\0" * (LABEL_BYTES - 32))
    before = b_dev.read_bytes()[:LABEL_BYTES]
    with pytest.raises(ConfigError, match="labelled before labels named their owner"):
        Store.open(dataclasses.replace(a, nvmeof=dataclasses.replace(a.nvmeof, device=str(b_dev))))
    assert b_dev.read_bytes()[:LABEL_BYTES] == before
    assert _served(b, prompts) == [2, 2] and _served(a, prompts) == [2, 2]


def test_a_label_from_before_owner_records_is_kept_and_completed(tmp_path: Path) -> None:
    cfg, dev = make(tmp_path)
    prompts = [(prompt(0, 2), page_data(0, 2))]
    with Store.open(cfg) as s:
        s.put(*prompts[0])
    with open(dev, "r+b") as f:  # magic + identity, zeros after: the label as written before
        f.seek(32)
        f.write(b"\0" * (LABEL_BYTES - 32))
    assert _served(cfg, prompts) == [2]
    assert label_data_bytes(dev.read_bytes()[:LABEL_BYTES]) == SLOTS * PB


def test_a_label_from_before_owner_records_is_taken_after_the_index_is_lost(tmp_path: Path) -> None:
    """An old label cannot name its owner: the documented reset (remove the directory)
    must still work for a store not opened since labels carried owners."""
    cfg, dev = make(tmp_path)
    with Store.open(cfg) as s:
        s.put(prompt(0, 2), page_data(0, 2))
    with open(dev, "r+b") as f:          # the label as written before owner records
        f.seek(32)
        f.write(b"\0" * (LABEL_BYTES - 32))
    shutil.rmtree(cfg.path)
    tokens, data = prompt(1, 2), page_data(1, 2)
    with Store.open(cfg) as s:
        assert s.put(tokens, data).stored == 2
    assert _served(cfg, [(tokens, data)]) == [2]


def test_a_store_in_a_very_long_path_fits_its_label_and_knows_it(tmp_path: Path) -> None:
    deep = tmp_path
    for i in range(8):                   # 800 bytes of path, six times that as escaped JSON
        deep = deep / (f"{i}" + "\x01" * 99)
    deep.mkdir(parents=True)
    cfg, dev = make(tmp_path)
    cfg = dataclasses.replace(cfg, path=str(deep / "store"))
    prompts = [(prompt(0, 2), page_data(0, 2))]
    with Store.open(cfg) as s:
        s.put(*prompts[0])
    assert dev.read_bytes()[:LABEL_BYTES].count(b"xxh3:") == 1
    shutil.rmtree(cfg.path)              # its own namespace, after an index loss: taken back
    assert _served(cfg, prompts) == [0]


def test_an_integer_port_is_text_as_sysfs_has_it() -> None:
    cfg = NvmeofConfig(transport="rdma", traddr="10.77.0.1", trsvcid=4420, subnqn="nqn.x:y")  # type: ignore[arg-type]
    assert cfg.trsvcid == "4420"
    with pytest.raises(ConfigError, match="trsvcid"):
        NvmeofConfig(transport="rdma", traddr="10.77.0.1", trsvcid=-1, subnqn="nqn.x:y")  # type: ignore[arg-type]


# -- the fabric link: which controller is the store's ------------------------------------

NQN = "nqn.2026-12.io.tierkv:kv"


def _fabric_cfg(**kw: object) -> NvmeofConfig:
    base: dict[str, object] = dict(transport="rdma", traddr="10.77.0.1", subnqn=NQN, hostnqn=HOSTNQN,
                                   io_timeout_s=1.0, monitor_interval_s=0.05, o_direct=False)
    base.update(kw)
    return NvmeofConfig(**base)  # type: ignore[arg-type]


def _namespace(dev: Path, name: str) -> None:
    with open(dev / name, "r+b") as f:
        f.truncate(LABEL_BYTES + SLOTS * PB)


def test_the_link_ignores_another_target_exporting_the_same_nqn(tmp_path: Path) -> None:
    sysfs, dev = tmp_path / "sys", tmp_path / "dev"
    add_controller(sysfs, ctrl=0, subsys=1, nqn=NQN, address="traddr=10.99.0.2,trsvcid=4420", dev_root=dev)
    link = FabricLink(_fabric_cfg(), connect=False, sysfs_root=str(sysfs), dev_root=str(dev))
    st = link.status()
    assert not st.live and st.device is None and "at 10.77.0.1:4420" in st.detail
    with pytest.raises(TierIOError, match="may not connect"):
        link.attach()
    # once the configured target is connected too, its namespace is the one used
    add_controller(sysfs, ctrl=1, subsys=2, nqn=NQN, heads={2: 1}, dev_root=dev)
    assert link.attach() == str(dev / "nvme2n2")


def test_the_link_ignores_a_controller_of_another_host_nqn(tmp_path: Path) -> None:
    sysfs, dev = tmp_path / "sys", tmp_path / "dev"
    add_controller(sysfs, ctrl=0, subsys=1, nqn=NQN, dev_root=dev)
    link = FabricLink(_fabric_cfg(hostnqn="nqn.2026-12.io.tierkv:another-host"), connect=False,
                      sysfs_root=str(sysfs), dev_root=str(dev))
    assert not link.status().live


def test_a_failed_open_disconnects_what_it_connected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import nvmeof.host
    from nvmeof.sysfs import get_controller
    sysfs, dev = tmp_path / "sys", tmp_path / "dev"
    gone: list[str] = []

    def fake_connect(*args: object, **kw: object) -> object:
        add_controller(sysfs, ctrl=0, subsys=1, nqn=NQN, dev_root=dev)  # namespace 1 only
        return get_controller("nvme0", str(sysfs))

    def fake_disconnect(**kw: object) -> int:
        gone.append(str(kw["name"]))
        return 1

    monkeypatch.setattr(nvmeof.host, "connect", fake_connect)
    monkeypatch.setattr(nvmeof.host, "disconnect", fake_disconnect)
    cfg = _fabric_cfg(nsid=2, disconnect_on_close=True)
    link = FabricLink(cfg, connect=True, sysfs_root=str(sysfs), dev_root=str(dev))
    with pytest.raises(TierIOError, match="namespace 2 has no block device"):
        open_nvmeof_tier(cfg, PB, header_bytes=LABEL_BYTES, connect=True, link=link)
    assert gone == ["nvme0"]


# -- a namespace that grew ----------------------------------------------------------------

@pytest.fixture
def loop_device(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A real block device (a loop device over a file), for root where losetup works."""
    backing = tmp_path / "ns.img"
    with open(backing, "wb") as f:
        f.truncate(LABEL_BYTES + SLOTS * PB)
    if os.geteuid() != 0 or shutil.which("losetup") is None:
        pytest.skip("needs root and losetup for a loop block device")
    res = subprocess.run(["losetup", "-f", "--show", str(backing)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"no loop device here: {res.stderr.strip()}")
    node = Path(res.stdout.strip())
    try:
        yield node, backing
    finally:
        subprocess.run(["losetup", "-d", str(node)], check=False)


def test_a_grown_namespace_keeps_the_size_the_store_was_created_with(tmp_path: Path,
                                                                     loop_device: tuple[Path, Path]) -> None:
    node, backing = loop_device
    cfg = StoreConfig(path=str(tmp_path / "store"), model_id="m", layout=LAYOUT,
                      nvmeof=NvmeofConfig(device=str(node), io_timeout_s=2.0, monitor_interval_s=0.05))
    tokens, data = prompt(0, 2), page_data(0, 2)
    with Store.open(cfg) as s:
        assert s.put(tokens, data).stored == 2
    with open(backing, "r+b") as f:  # the target's admin grows the namespace
        f.truncate(LABEL_BYTES + 2 * SLOTS * PB)
    subprocess.run(["losetup", "-c", str(node)], check=True)
    with Store.open(cfg) as s:
        assert s.stats().tiers["nvmeof"].capacity_slots == SLOTS
        n, out = load(s, tokens, 2)
        assert n == 2 and np.array_equal(out, data)


def test_a_local_tier_on_a_raw_device_of_another_store_is_refused(tmp_path: Path,
                                                                   loop_device: tuple[Path, Path]) -> None:
    """A local NVMe tier on a block device is shared media as a namespace is: after device
    names move, another store's drive is refused, not relabelled (its pages kept)."""
    node, _ = loop_device
    mine = StoreConfig(path=str(tmp_path / "a"), model_id="m", layout=LAYOUT,
                       nvme=NvmeConfig(SLOTS * PB, path=str(node)))
    tokens, data = prompt(0, 2), page_data(0, 2)
    with Store.open(mine) as s:
        assert s.put(tokens, data).stored == 2
    before = node.read_bytes()[:LABEL_BYTES]
    with pytest.raises(ConfigError, match="belongs to another tierkv store"):
        Store.open(dataclasses.replace(mine, path=str(tmp_path / "b")))
    assert node.read_bytes()[:LABEL_BYTES] == before
    with Store.open(mine) as s:
        n, out = load(s, tokens, 2)
        assert n == 2 and np.array_equal(out, data)
