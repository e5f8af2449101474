"""nvmeof: NVMe over Fabrics target and host plumbing for tierkv's NVMe-oF tier.

A standalone package: it never imports ``tierkv``. The target half lives in
``model`` (nvmetcli's save/restore JSON as frozen dataclasses), ``auth``
(DH-HMAC-CHAP secrets), ``spec`` (short TOML specs turned into configs) and
``configfs`` (apply/teardown on the kernel's nvmet configfs tree). ``python3 -m
nvmeof`` is the CLI. Importing this package imports nothing else.
"""

__all__ = ["auth", "cli", "configfs", "errors", "model", "spec"]
