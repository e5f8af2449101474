"""apply/clear/read_tree and the targeted operations against a plain-directory stand-in
of /sys/kernel/config/nvmet (configfs semantics emulated by nvmeof.cfstree)."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
from pathlib import Path

import pytest

from nvmeof import configfs
from nvmeof.auth import generate_secret
from nvmeof.cfstree import Tree, is_configfs
from nvmeof.configfs import ApplyMethod, OnError, apply, clear, link_port, read_tree, set_namespace_enabled, unlink_port
from nvmeof.errors import ApplyError, ConfigError
from nvmeof.model import NvmetConfig
from nvmeof.spec import generate, load_spec

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "nvmeof"
EXAMPLES = Path("/work/shared/data/nvmetcli")
SUB = "nqn.2026-12.io.tierkv:rig"
HOST = "nqn.2026-12.io.tierkv:host-rig"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "nvmet"
    r.mkdir()
    return r


@pytest.fixture
def rig() -> NvmetConfig:
    cfg = generate(load_spec(CONFIGS / "rig-rdma.toml"), random_bytes=lambda n: b"\x05" * n)
    key = generate_secret(random_bytes=lambda n: b"\x05" * n).encode()
    host = dataclasses.replace(cfg.hosts[0], dhchap_key=key)
    return dataclasses.replace(cfg, hosts=(host,))


def snapshot(root: Path) -> dict[str, str]:
    """Every path under root: 'dir', '-> target' for links, or file contents."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            out[rel] = "-> " + os.readlink(p) if p.is_symlink() else ("dir" if p.is_dir() else p.read_text())
    return out


def test_stand_in_is_not_configfs(root: Path) -> None:
    assert not is_configfs(str(root)) and Tree(str(root)).emulate


def test_apply_writes_the_exact_tree(root: Path, rig: NvmetConfig) -> None:
    key = generate_secret().encode()
    rig = dataclasses.replace(rig, hosts=(dataclasses.replace(rig.hosts[0], dhchap_key=key, dhchap_hash="hmac(sha512)"),))
    report = apply(rig, str(root))
    assert report.ok and report.method is ApplyMethod.CONFIGFS
    t = snapshot(root)
    s, h = "subsystems/" + SUB, "hosts/" + HOST
    assert t[h + "/dhchap_key"] == key and t[h + "/dhchap_hash"] == "hmac(sha512)"
    assert t[h + "/dhchap_dhgroup"] == "null\n"  # untouched default
    assert t[s + "/attr_allow_any_host"] == "0" and t[s + "/attr_serial"] == "tierkvrig0001"
    assert t[s + "/attr_model"] == "tierkv-rig"
    assert t[s + "/allowed_hosts/" + HOST] == "-> %s/hosts/%s" % (root, HOST)
    ns = s + "/namespaces/1"
    assert (t[ns + "/device_path"], t[ns + "/buffered_io"], t[ns + "/enable"]) == ("/run/tierkv-rig/ns1.img", "1", "1")
    for portid, trtype, svc in (("1", "rdma", "4420"), ("2", "tcp", "4421")):
        p = "ports/" + portid
        assert (t[p + "/addr_trtype"], t[p + "/addr_adrfam"], t[p + "/addr_traddr"], t[p + "/addr_trsvcid"],
                t[p + "/addr_treq"]) == (trtype, "ipv4", "10.77.0.1", svc, "not specified")
        assert t[p + "/subsystems/" + SUB] == "-> %s/%s" % (root, s)
        assert t[p + "/ana_groups/1"] == "dir"
    assert sorted(k for k in t if k.startswith(("hosts/", "subsystems/", "ports/")) and t[k] == "dir") == sorted([
        h, s, s + "/namespaces", s + "/allowed_hosts", ns, "ports/1", "ports/1/subsystems", "ports/1/referrals",
        "ports/1/ana_groups", "ports/1/ana_groups/1", "ports/2", "ports/2/subsystems", "ports/2/referrals",
        "ports/2/ana_groups", "ports/2/ana_groups/1"])


def test_apply_order_is_dependency_order(root: Path, rig: NvmetConfig) -> None:
    report = apply(rig, str(root))
    order = [os.path.relpath(p, root) for p in report.created]
    assert order == ["hosts/" + HOST, "subsystems/" + SUB, "subsystems/%s/allowed_hosts/%s" % (SUB, HOST),
                     "subsystems/%s/namespaces/1" % SUB, "ports/1", "ports/1/subsystems/" + SUB,
                     "ports/2", "ports/2/subsystems/" + SUB]
    w = [os.path.relpath(p, root) for p in report.written]
    ns = "subsystems/%s/namespaces/1/" % SUB
    assert w.index(ns + "device_path") < w.index(ns + "buffered_io") < w.index(ns + "enable")
    assert w.index("subsystems/%s/attr_allow_any_host" % SUB) < w.index("subsystems/%s/attr_model" % SUB)
    assert w.index("ports/1/addr_trtype") < w.index("ports/1/addr_trsvcid")
    assert all("secret" not in x for x in w)


def test_apply_abort_rolls_back_what_it_created(root: Path, rig: NvmetConfig) -> None:
    Tree(str(root)).prepare()
    (root / "ports" / "2").write_text("in the way")  # a file where port 2's directory must go
    before = snapshot(root)
    with pytest.raises(ApplyError, match="rolled back") as e:
        apply(rig, str(root))
    assert [os.path.relpath(f.path, root) for f in e.value.failures] == ["ports/2"]
    assert e.value.failures[0].error == os.strerror(errno.EEXIST)
    assert snapshot(root) == before


def test_apply_collect_records_and_continues(root: Path, rig: NvmetConfig) -> None:
    Tree(str(root)).prepare()
    (root / "ports" / "2").write_text("in the way")
    report = apply(rig, str(root), on_error="collect")
    assert not report.ok and [os.path.relpath(f.path, root) for f in report.failures] == ["ports/2"]
    assert (root / "ports" / "1" / "subsystems" / SUB).is_symlink()  # port 1 still came up
    assert (root / "subsystems" / SUB / "namespaces" / "1" / "enable").read_text() == "1"


def test_failed_device_attribute_skips_enable(root: Path, rig: NvmetConfig) -> None:
    """An attribute that cannot be written (here a directory in its place) must not be
    followed by enabling the namespace on a half-set device."""
    t = Tree(str(root))
    t.prepare()
    ns = root / "subsystems" / SUB / "namespaces" / "1"
    t.mkdir(str(root / "subsystems" / SUB), configfs.Kind.SUBSYSTEM)
    t.mkdir(str(ns), configfs.Kind.NAMESPACE)
    (ns / "buffered_io").unlink()
    (ns / "buffered_io").mkdir()
    report = apply(rig, str(root), on_error=OnError.COLLECT)
    assert [f.error for f in report.failures] == [os.strerror(errno.EISDIR)]
    assert report.failures[0].value == "1"
    assert (ns / "enable").read_text() == "0\n"
    assert (root / "ports" / "1" / "subsystems" / SUB).is_symlink()  # the port itself was fine


def test_secret_values_are_not_reported(root: Path, rig: NvmetConfig) -> None:
    Tree(str(root)).prepare()
    (root / "hosts" / HOST).mkdir()  # an "object" without attribute files
    report = apply(rig, str(root), on_error="collect")
    assert report.failures[0].value == "<secret>" and report.failures[0].error == os.strerror(errno.ENOENT)


def test_apply_refuses_an_invalid_config_and_a_missing_root(tmp_path: Path, rig: NvmetConfig) -> None:
    bad = dataclasses.replace(rig, ports=(dataclasses.replace(rig.ports[0], subsystems=("nqn.2026-12.io.x:y",)),))
    with pytest.raises(ConfigError, match="not in subsystems"):
        apply(bad, str(tmp_path))
    with pytest.raises(ApplyError, match="does not exist"):
        apply(rig, str(tmp_path / "absent"))
    (tmp_path / "file").write_text("")
    with pytest.raises(ApplyError, match="root .*/file is not a directory"):
        apply(rig, str(tmp_path / "file"))
    with pytest.raises(ConfigError, match="nvmetcli only writes"):
        apply(rig, str(tmp_path), nvmetcli="/usr/sbin/nvmetcli")


def test_read_tree_and_clear_refuse_a_missing_or_file_root(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    for fn in (read_tree, clear):
        with pytest.raises(ApplyError, match="root .*/absent does not exist"):
            fn(str(tmp_path / "absent"))
        with pytest.raises(ApplyError, match="root .*/file is not a directory"):
            fn(str(tmp_path / "file"))


def test_clear_everything_leaves_an_empty_root(root: Path, rig: NvmetConfig) -> None:
    cfg = NvmetConfig.load(EXAMPLES / "tcp.json")
    apply(cfg, str(root))
    apply(rig, str(root))
    report = clear(str(root))
    assert report.ok, report.failures
    assert snapshot(root) == {"hosts": "dir", "ports": "dir", "subsystems": "dir"}
    rel = [os.path.relpath(p, root) for p in report.removed]
    assert rel.index("ports/1/subsystems/nvmet-always") < rel.index("ports/1") < rel.index("subsystems/nvmet-always")
    assert rel.index("subsystems/%s/namespaces/1" % SUB) < rel.index("subsystems/" + SUB) < rel.index("hosts/" + HOST)


def test_clear_with_a_config_only_removes_its_objects(root: Path, rig: NvmetConfig) -> None:
    other = NvmetConfig.load(EXAMPLES / "fc.json")  # port 3: no clash with the rig's ports 1 and 2
    apply(other, str(root))
    before = snapshot(root)
    apply(rig, str(root))
    report = clear(str(root), rig)
    assert report.ok and snapshot(root) == before
    assert clear(str(root), rig).removed == ()  # idempotent


def test_clear_keeps_shared_objects(root: Path, rig: NvmetConfig) -> None:
    apply(rig, str(root))
    other = NvmetConfig.load(EXAMPLES / "rdma.json")
    other = dataclasses.replace(other, ports=(dataclasses.replace(other.ports[0], portid=1, addr=rig.ports[0].addr),))
    apply(dataclasses.replace(other, hosts=()), str(root))  # also links port 1 to testnqn
    report = clear(str(root), rig)
    assert (root / "ports" / "1" / "subsystems" / "testnqn").is_symlink()
    assert any("kept" in n and "ports/1" in n for n in report.notes)
    assert not (root / "subsystems" / SUB).exists()


def test_read_tree_round_trips_an_applied_config(root: Path, rig: NvmetConfig) -> None:
    apply(rig, str(root))
    got = read_tree(str(root))
    assert [(h.nqn, h.dhchap_key) for h in got.hosts] == [(HOST, rig.hosts[0].dhchap_key)]
    (sub,) = got.subsystems
    want = rig.subsystems[0]
    assert {k: sub.attr[k] for k in want.attr} == dict(want.attr)
    assert sub.allowed_hosts == want.allowed_hosts
    ns = sub.namespaces[0]
    assert (ns.nsid, ns.device.path, ns.enable, ns.buffered_io) == (1, "/run/tierkv-rig/ns1.img", 1, 1)
    assert [(p.portid, p.addr.to_dict(), p.subsystems) for p in got.ports] == \
        [(p.portid, p.addr.to_dict(), p.subsystems) for p in rig.ports]
    got.validate()
    # what save reads applies again to an identical tree
    again = root.parent / "again"
    again.mkdir()
    apply(got, str(again))
    assert read_tree(str(again)).to_dict() == json.loads(got.to_json()) | {
        "subsystems": [s | {"attr": s["attr"] | {"serial": "tierkvrig0001"}} for s in got.to_dict()["subsystems"]]}


def test_read_tree_of_the_tcp_example_keeps_ana_groups(root: Path) -> None:
    cfg = NvmetConfig.load(EXAMPLES / "tcp.json")
    apply(cfg, str(root))
    port = read_tree(str(root)).ports[0]
    assert port.ana_groups[0].ana == {"state": "optimized"} and port.param["inline_data_size"] == "16384"


def test_targeted_operations(root: Path, rig: NvmetConfig) -> None:
    apply(rig, str(root))
    enable = root / "subsystems" / SUB / "namespaces" / "1" / "enable"
    set_namespace_enabled(SUB, 1, False, root=str(root))
    assert enable.read_text() == "0"
    set_namespace_enabled(SUB, 1, True, root=str(root))
    assert enable.read_text() == "1"
    unlink_port(2, SUB, root=str(root))
    assert not (root / "ports" / "2" / "subsystems" / SUB).exists()
    assert read_tree(str(root)).ports[1].subsystems == ()
    link_port(2, SUB, root=str(root))
    assert os.readlink(root / "ports" / "2" / "subsystems" / SUB) == str(root / "subsystems" / SUB)
    with pytest.raises(ApplyError, match="cannot link port 2") as e:
        link_port(2, SUB, root=str(root))
    assert e.value.failures[0].error == os.strerror(errno.EEXIST)
    with pytest.raises(ApplyError, match="cannot enable namespace 7"):
        set_namespace_enabled(SUB, 7, True, root=str(root))
    with pytest.raises(ApplyError, match="cannot unlink port 3"):
        unlink_port(3, SUB, root=str(root))


def test_emulated_rmdir_refuses_objects_that_still_hold_items(root: Path, rig: NvmetConfig) -> None:
    apply(rig, str(root))
    t = Tree(str(root))
    with pytest.raises(OSError) as e:
        t.rmdir(str(root / "ports" / "1"), configfs.Kind.PORT)
    assert e.value.errno == errno.ENOTEMPTY
    assert (root / "ports" / "1" / "addr_trtype").exists()  # nothing half-removed


def test_nvmetcli_is_used_when_given_and_can_express_the_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in nvmetcli script records its argv; apply must call ``restore FILE``."""
    log = tmp_path / "argv"
    exe = tmp_path / "nvmetcli"
    exe.write_text("#!/bin/sh\necho \"$@\" > %s\ncp \"$2\" %s.json\necho 'Could not x, skipped'\n" % (log, log))
    exe.chmod(0o755)
    cfg = NvmetConfig.load(EXAMPLES / "rdma.json")
    report = apply(cfg, nvmetcli=str(exe), on_error="collect")
    assert report.method is ApplyMethod.NVMETCLI and log.read_text().startswith("restore ")
    assert NvmetConfig.load(str(log) + ".json") == cfg
    assert [f.error for f in report.failures] == ["Could not x, skipped"]
    rig = generate(load_spec(CONFIGS / "rig-rdma.toml"))
    with pytest.raises(ConfigError, match="buffered_io"):
        apply(rig, nvmetcli=str(exe))
    assert configfs.nvmetcli_gaps(rig) == ["subsystem %r namespace 1 buffered_io" % SUB]


def test_reapplying_to_a_live_target_rewrites_nothing(root: Path, rig: NvmetConfig) -> None:
    # The kernel refuses rewrites of addr_* on an enabled port and device_path on an
    # enabled namespace, so a second apply of the same config must not write them.
    first = apply(rig, str(root), use_nvmetcli=False)
    assert first.ok and first.written
    again = apply(rig, str(root), use_nvmetcli=False)
    # Secrets are written again (never read back to compare); the kernel takes that live.
    assert again.ok and not again.created
    assert [w for w in again.written if "dhchap" not in os.path.basename(w)] == []


def test_read_tree_strips_the_kernels_padding(root: Path, rig: NvmetConfig) -> None:
    apply(rig, str(root))
    serial = root / "subsystems" / SUB / "attr_serial"
    serial.write_text("tierkvrig0001       \n")  # the kernel shows attr_serial padded to 20
    saved = read_tree(str(root))
    assert saved.subsystems[0].attr["serial"] == "tierkvrig0001"  # as nvmetcli's get_attr reads it
    # load -> apply -> save keeps the serial
    again = root.parent / "again"
    again.mkdir()
    apply(NvmetConfig.from_dict(saved.to_dict()), str(again))
    assert read_tree(str(again)).subsystems[0].attr["serial"] == "tierkvrig0001"
