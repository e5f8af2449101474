"""The QEMU NVMe-oF test rig behind ``tierkv rig up|test|down`` (see ``docs/rig.md``).

:mod:`tierkv.rig.plan` builds what to run as data (options, command lines, the setup's
answer); :mod:`tierkv.rig.run` runs it (setup, one boot, reading the guest's results,
teardown); :mod:`tierkv.rig.cli` is the command. The scripts themselves live in
``tools/rig/`` (``setup.sh`` on the host, ``guest.sh`` inside the VM) and the tests in
``tests/rig/``. Importing this package is cheap: no torch, no subprocess.
"""

from __future__ import annotations

from tierkv.rig.cli import add_parser

__all__ = ["add_parser"]
