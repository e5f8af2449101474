"""nvmeof: NVMe over Fabrics target and host plumbing for tierkv's NVMe-oF tier.

A standalone package: it never imports ``tierkv``. The target half lives in
``model`` (nvmetcli's save/restore JSON as frozen dataclasses, checked by ``validate``),
``auth`` (DH-HMAC-CHAP secrets), ``spec`` (short TOML specs turned into configs) and
``configfs`` (apply/teardown on the kernel's nvmet configfs tree, through ``cfstree``).
The host half: ``host`` (discover, connect, disconnect, through ``nvmecli`` or libnvme),
``sysfs`` (controllers and namespaces as the kernel shows them) and ``diagnose`` (host
identity, why a connect failed). ``errors`` roots every exception. ``python3 -m nvmeof``
is the CLI. Importing this package imports nothing else.
"""

__all__ = ["auth", "cfstree", "cli", "configfs", "diagnose", "errors", "host", "model", "nvmecli", "spec", "sysfs",
           "validate"]
