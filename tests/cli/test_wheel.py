"""A wheel built from this tree works outside it: built offline from a copy of what an sdist
holds (pyproject.toml, setup.py, README.md, tierkv/, nvmeof/), installed with ``--no-deps``
into a fresh venv that sees the system's packages (torch, numpy, ...), and run from a folder
that is not the checkout.

The copy's ``__version__`` is changed before the build, so the test also shows that the
version lives in one place: the wheel's name, its metadata and ``tierkv --version`` follow
``tierkv/__init__.py``. The system site-packages hold tierkv's editable install too; its
finder comes after the ordinary path finder, so the venv's copy wins (checked below, not
assumed). The build compiles the C extensions: this module takes about 15 s on 2 cores.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import tierkv

ROOT = Path(__file__).resolve().parents[2]
SDIST = ("pyproject.toml", "setup.py", "README.md", "tierkv", "nvmeof")
VERSION = f"{tierkv.__version__}+wheeltest"
#: Generous limits that only stop a hung build or command; nothing here asserts a time.
BUILD_TIMEOUT_S = 900
RUN_TIMEOUT_S = 300


@dataclass(frozen=True)
class Installed:
    venv: Path
    wheel: Path
    cwd: Path          # outside the checkout, empty
    env: dict[str, str]

    def run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.venv / "bin" / argv[0]), *argv[1:]], cwd=self.cwd, env=self.env,
                              capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def _copy_sources(dst: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info", "build")
    for name in SDIST:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=ignore)
        else:
            shutil.copy2(src, dst / name)
    init = dst / "tierkv" / "__init__.py"
    text, n = re.subn(r'(?m)^__version__ = "[^"]*"$', f'__version__ = "{VERSION}"', init.read_text())
    assert n == 1, "tierkv/__init__.py must assign __version__ once, as a plain string"
    init.write_text(text)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    for module in ("pip", "setuptools"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"building a wheel offline needs {module} installed")
    base = tmp_path_factory.mktemp("wheel")
    src, dist, venv, cwd = base / "src", base / "dist", base / "venv", base / "elsewhere"
    src.mkdir()
    cwd.mkdir()
    _copy_sources(src)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "TIERKV_KV_DIR")}
    env.update(PYTHONNOUSERSITE="1", PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(dist), str(src)], check=True, env=env, timeout=BUILD_TIMEOUT_S)
    (wheel,) = dist.glob("tierkv-*.whl")
    # No pip of its own: the system's pip, visible through --system-site-packages, installs into it.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                   check=True, timeout=RUN_TIMEOUT_S)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps", "-q", str(wheel)],
                   check=True, env=env, cwd=cwd, timeout=RUN_TIMEOUT_S)
    return Installed(venv, wheel, cwd, env)


def test_the_venv_imports_the_wheel_not_the_checkout(installed: Installed) -> None:
    out = installed.run("python", "-c", "import tierkv, tierkv.plan.hardware as h; "
                        "print(tierkv.__file__); print(h.PROFILE_DIR)")
    assert out.returncode == 0, out.stderr
    module, profiles = (Path(line) for line in out.stdout.splitlines())
    assert module.is_relative_to(installed.venv) and not module.is_relative_to(ROOT)
    assert sorted(p.name for p in profiles.glob("*.toml")) == ["dev-box.toml", "h200-node.toml"]


def test_version_comes_from_one_place(installed: Installed) -> None:
    assert installed.wheel.name.startswith(f"tierkv-{VERSION}-")
    out = installed.run("tierkv", "--version")
    assert (out.returncode, out.stdout.strip()) == (0, f"tierkv {VERSION}"), out.stderr
    meta = installed.run("python", "-c", "import importlib.metadata as m; print(m.version('tierkv'))")
    assert meta.stdout.strip() == VERSION, meta.stderr


def test_plan_finds_its_hardware_profiles(installed: Installed) -> None:
    out = installed.run("tierkv", "plan", "--model", "llama-3.1-8b", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["model"]["name"] == "llama-3.1-8b" and doc["hardware"]["profile"] == "h200-node"


def test_plan_takes_a_hardware_file(installed: Installed) -> None:
    profile = installed.cwd / "mine.toml"
    profile.write_text((ROOT / "tierkv" / "plan" / "profiles" / "dev-box.toml").read_text()
                       .replace('name = "dev-box"', 'name = "mine"'))
    out = installed.run("tierkv", "plan", "--model", "smollm2-135m", "--hardware", str(profile),
                        "--synthetic", "100", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["hardware"]["profile"] == "mine"


def test_bench_codec_says_what_it_needs(installed: Installed) -> None:
    """An installed tierkv has no checkout beside it: without --kv or TIERKV_KV_DIR the codec
    benchmark says so in one line (exit 2), and never reads ../shared from the current folder."""
    kv = installed.cwd.parent / "shared" / "data" / "kv"
    kv.mkdir(parents=True)
    (kv / "layer.safetensors").write_bytes(b"not read")
    out = installed.run("tierkv", "bench", "codec", "--json")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "--kv" in out.stderr and "TIERKV_KV_DIR" in out.stderr, out.stderr
