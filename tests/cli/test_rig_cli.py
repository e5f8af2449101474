"""``tierkv rig`` on the host, without a VM: argument parsing, the command lines it
would run (as data), reading a guest's results, and the ``--json`` shape of a failure."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from tierkv.cli.main import main
from tierkv.errors import InputError
from tierkv.rig.recipe import (GuestMode, RigEnv, RigError, RigOptions, boot_command, forwarded_env, load_env,
                             parse_env_file, preconditions, pytest_args, setup_command)
from tierkv.rig.run import RunCounts, check_purge, parse_junit, read_guest, rig_processes, teardown

ENV_TEXT = """RIG_WORK=/w
RIG_KVER=6.1.0-57-amd64
RIG_KERNEL=/w/kernel/boot/vmlinuz-6.1.0-57-amd64
RIG_VNG=/w/vng-venv/bin/vng
RIG_VNG_BIN=/w/vng-venv/bin
RIG_GUEST_PY=/w/guest-venv/bin/python
"""


def env() -> RigEnv:
    return parse_env_file(ENV_TEXT)


def test_env_file_parses_and_names_missing_keys() -> None:
    e = env()
    assert e.kver == "6.1.0-57-amd64" and e.guest_python == Path("/w/guest-venv/bin/python")
    with pytest.raises(RigError, match="RIG_KERNEL, RIG_VNG"):
        parse_env_file("RIG_KVER=x\nRIG_VNG_BIN=/b\nRIG_GUEST_PY=/p\n")


def test_boot_command_is_tcg_with_the_venv_first_on_path(tmp_path: Path) -> None:
    opts = RigOptions(work_dir=tmp_path, cpus=3, memory="1536M")
    cmd = boot_command(opts, env(), GuestMode.TEST, ["-k", "rdma and not tcp"], {"TIERKV_RIG_BACKEND": "nvme-cli"},
                       path="/usr/bin")
    argv = list(cmd.argv)
    assert argv[:3] == ["/w/vng-venv/bin/vng", "--run", "/w/kernel/boot/vmlinuz-6.1.0-57-amd64"]
    assert "--disable-kvm" in argv
    assert argv[argv.index("--cpus") + 1] == "3" and argv[argv.index("--memory") + 1] == "1536M"
    assert argv[argv.index("--rwdir") + 1] == str(tmp_path / "out")
    assert cmd.env["PATH"] == "/w/vng-venv/bin:/usr/bin"
    inner = shlex.split(argv[argv.index("--exec") + 1])  # one shell line for the guest
    assert inner[:3] == ["env", "TIERKV_RIG_BACKEND=nvme-cli", "TIERKV_RIG_PY=/w/guest-venv/bin/python"]
    assert inner[3:] == ["bash", str(opts.guest_script), "test", str(tmp_path / "out"), "-k", "rdma and not tcp"]
    assert "vng" in cmd.shell() and "PATH=" in cmd.shell()


def test_setup_command_and_pytest_args(tmp_path: Path) -> None:
    cmd = setup_command(RigOptions(work_dir=tmp_path))
    assert cmd.argv[0] == "bash" and cmd.argv[1].endswith("tools/rig/setup.sh")
    assert cmd.env == {"RIG_WORK": str(tmp_path)}
    assert pytest_args("fault", ["-x"]) == ["-k", "fault", "-x"]
    assert pytest_args(None, []) == []


def test_forwarded_env_keeps_rig_knobs_only() -> None:
    got = forwarded_env({"TIERKV_RIG_BACKEND": "libnvme", "TIERKV_RIG_PY": "/x", "TIERKV_RIG_GUEST": "1",
                         "HOME": "/root", "TIERKV_RIG_bad-name": "x"})
    assert got == {"TIERKV_RIG_BACKEND": "libnvme"}


@pytest.mark.parametrize("kw", [{"cpus": 0}, {"memory": "2GB"}, {"memory": "lots"}, {"timeout_s": 0}])
def test_bad_options_are_input_errors(kw: dict[str, object]) -> None:
    with pytest.raises(InputError):
        RigOptions(**kw)  # type: ignore[arg-type]


def test_preconditions_name_the_missing_tool(tmp_path: Path) -> None:
    opts = RigOptions(work_dir=tmp_path)
    assert preconditions(opts, find=lambda name: "/usr/bin/" + name) == []
    problems = preconditions(opts, find=lambda name: None)
    assert "no /dev/kvm needed, but qemu-system-x86_64 missing: run tools/rig/setup.sh" in problems
    assert any("busybox" in p for p in problems)
    assert any("source checkout" in p for p in preconditions(RigOptions(repo=tmp_path), find=lambda n: "/x"))


def test_load_env_checks_setup_ran(tmp_path: Path) -> None:
    opts = RigOptions(work_dir=tmp_path)
    with pytest.raises(RigError, match="not set up"):
        load_env(opts)
    opts.env_file.write_text(ENV_TEXT)
    with pytest.raises(RigError, match="kernel /w/kernel.* is gone"):
        load_env(opts)


def test_parse_args_of_each_subcommand() -> None:
    from tierkv.cli.main import build_parser

    args = build_parser().parse_args(["rig", "test", "-k", "rdma", "--cpus", "4", "--", "-x", "tests/rig/a.py"])
    assert (args.rig_command, args.keyword, args.cpus, args.pytest_args) == ("test", "rdma", 4, ["-x", "tests/rig/a.py"])
    assert args.memory == "2G" and not args.json
    down = build_parser().parse_args(["rig", "down", "--purge", "--work", "/tmp/x"])
    assert down.purge and down.work == "/tmp/x"


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rig"]) == 2
    assert main(["rig", "up", "--cpus", "many"]) == 2


def test_failed_precondition_is_one_json_object(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # --no-setup on an empty work folder: nothing to boot, and --json still prints JSON.
    status = main(["rig", "test", "--json", "--no-setup", "--work", str(tmp_path)])
    out = json.loads(capsys.readouterr().out)
    assert status == 1
    assert out["command"] == "test" and out["ok"] is False and out["exit_status"] == 1
    assert isinstance(out["error"], str) and out["error"] and out["steps"] == []
    bad = main(["rig", "up", "--json", "--no-setup", "--memory", "2GB", "--work", str(tmp_path)])
    assert bad == 2 and "--memory" in json.loads(capsys.readouterr().out)["error"]


def test_guest_results_are_read_back(tmp_path: Path) -> None:
    opts = RigOptions(work_dir=tmp_path)
    opts.out_dir.mkdir()
    (opts.out_dir / "status.json").write_text('{"mode": "test", "exit_status": 1, "failed_step": ""}\n')
    (opts.out_dir / "phases.tsv").write_text("boot\t20.5\nmodules\t23.0\npytest\t80.0\n")
    (opts.out_dir / "junit.xml").write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest" errors="1" failures="2" skipped="1" '
        'tests="10" time="3"></testsuite></testsuites>')
    rep = read_guest(opts, GuestMode.TEST)
    assert rep.exit_status == 1 and rep.failed_step is None
    assert rep.phases == {"boot": 20.5, "modules": 2.5, "pytest": 57.0}
    assert rep.counts == RunCounts(passed=6, failed=2, errors=1, skipped=1) and rep.counts.total == 10
    assert parse_junit(tmp_path / "missing.xml") is None


def test_a_guest_that_wrote_nothing_is_a_failure(tmp_path: Path) -> None:
    rep = read_guest(RigOptions(work_dir=tmp_path), GuestMode.CHECK)
    assert rep.exit_status is None and rep.counts is None and rep.phases == {}


def test_down_finds_rig_qemus_by_kernel_path_and_removes_state(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    for pid, argv in (("11", ["/usr/bin/qemu-system-x86_64", "-kernel", "/w/kernel/boot/vmlinuz-6.1.0-57-amd64"]),
                      ("12", ["/usr/bin/qemu-system-x86_64", "-kernel", "/other/vmlinuz"]),
                      ("13", ["/bin/bash", "/w/kernel/boot/vmlinuz-6.1.0-57-amd64"])):
        (proc / pid).mkdir(parents=True)
        (proc / pid / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (proc / "self").mkdir()
    opts = RigOptions(work_dir=tmp_path / "work")
    assert rig_processes(opts, env(), str(proc)) == [11]
    opts.out_dir.mkdir(parents=True)
    (opts.out_dir / "guest.log").write_text("x")
    opts.host_log.write_text("x")
    result = teardown(opts, None, purge=False)
    assert not opts.out_dir.exists() and not opts.host_log.exists() and opts.work_dir.exists()
    assert result["killed"] == []
    opts.env_file.write_text(ENV_TEXT)  # what setup.sh leaves: the mark of a rig work folder
    teardown(opts, None, purge=True)
    assert not opts.work_dir.exists()


def test_purge_refuses_a_folder_that_is_not_a_rig_work_folder(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    (data / "out").mkdir(parents=True)
    (data / "precious.txt").write_text("keep")
    assert main(["rig", "down", "--purge", "--work", str(data)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{data} is not a rig work folder (no rig.env" in err
    assert main(["rig", "down", "--purge", "--json", "--work", str(data)]) == 2
    out = json.loads(capsys.readouterr().out)
    assert out["command"] == "down" and out["ok"] is False and out["exit_status"] == 2 and "rig.env" in out["error"]
    assert (data / "precious.txt").read_text() == "keep" and (data / "out").is_dir()  # nothing removed, not even out/
    with pytest.raises(RigError, match="not a directory"):
        teardown(RigOptions(work_dir=data / "precious.txt"), None, purge=True)
    assert (data / "precious.txt").exists()


def test_purge_refuses_root_home_and_links(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "rig.env").write_text(ENV_TEXT)
    monkeypatch.setenv("HOME", str(home))
    with pytest.raises(RigError, match="refusing to delete"):
        check_purge(home)
    with pytest.raises(RigError, match="refusing to delete /;"):
        check_purge(Path("/"))
    (tmp_path / "link").symlink_to(home)
    with pytest.raises(RigError, match="not a directory"):
        teardown(RigOptions(work_dir=tmp_path / "link"), None, purge=True)
    assert (home / "rig.env").exists()


def test_purge_removes_a_rig_work_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    work = tmp_path / "rig"
    for sub in ("kernel/boot", "vng-venv/bin", "guest-venv/bin", "out"):
        (work / sub).mkdir(parents=True)
    (work / "rig.env").write_text(ENV_TEXT)
    (work / "rig.lock").write_text("123\n")
    assert main(["rig", "down", "--purge", "--json", "--work", str(work)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and str(work) in out["removed"] and not work.exists() and tmp_path.exists()
    assert main(["rig", "down", "--purge", "--work", str(work)]) == 0  # already gone: nothing to do
