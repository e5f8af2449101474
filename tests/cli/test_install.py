"""``tools/install.sh`` installs every extra a command needs (``plot`` for ``--plot``, ``bench``
for the codec baselines, ...): all of pyproject's extras but those for hardware this machine
may lack, so that no command finds out after minutes of work that a package is missing."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Extras for hardware (CUDA, RDMA, libnvme): installed by hand where the hardware is.
HARDWARE_EXTRAS = {"cuda", "cuda13", "rdma", "nvme"}


def test_install_sh_installs_every_software_extra() -> None:
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    installs = re.findall(r"-e\s+'\.\[([\w,-]+)\]'", (ROOT / "tools" / "install.sh").read_text())
    assert len(installs) == 1, installs
    assert set(installs[0].split(",")) == extras - HARDWARE_EXTRAS
