#!/usr/bin/env bash
# Prepares the NVMe-oF rig (a QEMU/TCG guest running Debian's stock kernel, with nvmet,
# soft-RoCE and the NVMe/RDMA host as modules) in a work folder. Idempotent: every step is
# skipped when its result is already there, so a second run takes about a second.
#
# Called by `tierkv rig up|test` and tools/install.sh; safe to run by hand.
# Environment: RIG_WORK (work folder, default /tmp/tierkv-rig; keep it under /tmp: with the
# kernel under /var/tmp the guest found no modules).
# Writes $RIG_WORK/rig.env (shell KEY=VALUE lines) naming the kernel, vng and the guest
# Python; `tierkv rig` reads only that file. Exit status 0 on success, non-zero (with the
# reason on stderr) otherwise.
set -euo pipefail
WORK=${RIG_WORK:-/tmp/tierkv-rig}
mkdir -p "$WORK"
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
APT_UPDATED=0
apt_update() { [ "$APT_UPDATED" = 1 ] || { $SUDO apt-get update -qq; APT_UPDATED=1; }; }
log() { echo "rig setup: $*" >&2; }
# pip warns once per extra index entry it cannot list; those lines hide real errors.
quiet_pip() { grep -v 'is ignored: it is neither a file nor a directory' || true; }

# ---- Debian packages (apt-get update only when something is missing) ----
# busybox-static: virtme-ng builds its initramfs from it (boot fails without it).
PKGS="qemu-system-x86 kmod iproute2 nvme-cli ibverbs-utils ibverbs-providers rdma-core
      python3-pyverbs python3-nvme python3-venv busybox-static etcd-server"
missing=""
for p in $PKGS; do
    dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q 'install ok installed' || missing="$missing $p"
done
if [ -n "$missing" ]; then
    log "installing Debian packages:$missing"
    apt_update
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi

# ---- the guest kernel: the package linux-image-amd64 depends on today ----
kernel_pkg() { apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}'; }
KPKG=$(kernel_pkg)
if [ -z "$KPKG" ]; then apt_update; KPKG=$(kernel_pkg); fi
[ -n "$KPKG" ] || { echo "rig setup: apt-cache depends linux-image-amd64 names no kernel package" >&2; exit 1; }
KVER=${KPKG#linux-image-}
KDIR=$WORK/kernel
KIMG=$KDIR/boot/vmlinuz-$KVER
if [ ! -f "$KIMG" ] || [ ! -f "$KDIR/lib/modules/$KVER/modules.dep" ]; then
    log "fetching kernel $KPKG"
    rm -f "$WORK"/linux-image-*.deb
    (cd "$WORK" && { apt-get download -q "$KPKG" >/dev/null 2>&1 || { apt_update; apt-get download -q "$KPKG" >/dev/null; }; })
    dpkg -x "$WORK/${KPKG}"_*.deb "$KDIR"
    rm -f "$WORK"/linux-image-*.deb
    depmod -b "$KDIR" "$KVER"     # the .deb ships no modules.dep (its postinst makes it)
fi

# ---- virtme-ng in its own venv ----
VNG_VENV=$WORK/vng-venv
if ! "$VNG_VENV/bin/vng" --version >/dev/null 2>&1; then
    log "installing virtme-ng==1.42"
    rm -rf "$VNG_VENV"
    python3 -m venv "$VNG_VENV"
    "$VNG_VENV/bin/pip" install -q virtme-ng==1.42 2> >(quiet_pip >&2)
fi

# ---- the guest's Python: Debian's 3.11 (pyverbs and libnvme are built for it) ----
# torch: tierkv.store.api and the tiers import it, and so does tests/conftest.py; the CPU wheel
# pin keeps pip from pulling a multi-GB CUDA build. The project itself is not installed:
# guest.sh puts the checkout on PYTHONPATH, so nothing is written into the repo.
GUEST_VENV=$WORK/guest-venv
GUEST_REQS="numpy lmdb xxhash rich pytest hypothesis etcd3gw torch==2.13.0"
STAMP=$GUEST_VENV/.tierkv-reqs
if [ "$(cat "$STAMP" 2>/dev/null)" != "$GUEST_REQS" ] || ! "$GUEST_VENV/bin/python" -c 'import pytest, numpy, torch, pyverbs, libnvme' 2>/dev/null; then
    log "building the guest venv ($GUEST_REQS)"
    rm -rf "$GUEST_VENV"
    /usr/bin/python3 -m venv --system-site-packages "$GUEST_VENV"
    "$GUEST_VENV/bin/pip" install -q $GUEST_REQS 2> >(quiet_pip >&2)
    echo "$GUEST_REQS" > "$STAMP"
fi

# ---- the contract with `tierkv rig`: written last, atomically ----
cat > "$WORK/rig.env.tmp" <<EOF
RIG_WORK=$WORK
RIG_KVER=$KVER
RIG_KERNEL=$KIMG
RIG_VNG=$VNG_VENV/bin/vng
RIG_VNG_BIN=$VNG_VENV/bin
RIG_GUEST_PY=$GUEST_VENV/bin/python
EOF
mv "$WORK/rig.env.tmp" "$WORK/rig.env"
log "ready: kernel $KVER in $WORK"
