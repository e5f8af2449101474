"""The QEMU NVMe-oF test rig behind ``tierkv rig up|test|down`` (see ``docs/rig.md``).

:mod:`tierkv.rig.recipe` builds what to run as data (options, command lines, the setup's
answer); :mod:`tierkv.rig.run` runs it (setup, one boot, reading the guest's results,
teardown); the command is :mod:`tierkv.cli.rig`. The scripts themselves live in
``tools/rig/`` (``setup.sh`` on the host, ``guest.sh`` inside the VM) and the tests in
``tests/rig/``. Importing this package is cheap: no torch, no subprocess.
"""
