#!/bin/bash
# Runs INSIDE the rig guest, as root (booted by `tierkv rig up|test` through vng --exec).
# Brings up the stack the rig tests need, then either checks it (MODE=check) or runs the
# rig tests (MODE=test), and leaves its results in OUT, a folder shared writable with the
# host (vng --rwdir):
#   OUT/phases.tsv     one "name<TAB>seconds since boot" line per step
#   OUT/guest.log      everything this script and pytest printed
#   OUT/junit.xml      pytest's junit report (test mode)
#   OUT/doctor.json    `tierkv doctor --json`, when the project has the command (check mode)
#   OUT/status.json    {"mode", "exit_status", "failed_step"} written last
# Usage: guest.sh check|test OUT [PYTEST ARGS...]
# Environment: TIERKV_RIG_PY, the guest venv's python (required); other TIERKV_RIG_* knobs
# come from the host (`tierkv rig` forwards them): TIERKV_RIG_BACKEND (see tests/rig/conftest.py),
# TIERKV_RIG_TIME_IMPORT=1 (check mode also times `import tierkv.store.api`).
# Exit status: pytest's in test mode; in check mode 0 when every step worked. A failed
# bring-up step exits 3 before pytest runs.
set -u
MODE=${1:?usage: guest.sh check|test OUT [PYTEST ARGS...]}
OUT=${2:?usage: guest.sh check|test OUT [PYTEST ARGS...]}
shift 2
REPO=$(cd "$(dirname "$0")/../.." && pwd)
PY=${TIERKV_RIG_PY:?TIERKV_RIG_PY must name the guest venv python}
ADDR=10.77.0.1
BACKING=/run/tierkv-rig
EXIT_BRINGUP=3
exec > >(tee -a "$OUT/guest.log") 2>&1

phase() { printf '%s\t%s\n' "$1" "$(awk '{print $1}' /proc/uptime)" >> "$OUT/phases.tsv"; echo "### $1"; }
finish() {  # finish STATUS [FAILED_STEP]
    printf '{"mode": "%s", "exit_status": %d, "failed_step": "%s"}\n' "$MODE" "$1" "${2:-}" > "$OUT/status.json"
    sync
    exit "$1"
}
step() {  # step NAME CMD...: run CMD, record the phase, stop the run when it fails
    "${@:2}" || { echo "!!! rig bring-up step '$1' failed: ${*:2}"; finish $EXIT_BRINGUP "$1"; }
    phase "$1"
}
bring_up_rxe() {
    ip link set lo up &&
    ip link add dummy0 type dummy && ip addr add $ADDR/24 dev dummy0 && ip link set dummy0 up &&
    # Not lo: rxe attaches to it, but NVMe/RDMA connect then fails in rdma_resolve_route.
    rdma link add rxe0 type rxe netdev dummy0
}
mount_configfs() { mountpoint -q /sys/kernel/config || mount -t configfs none /sys/kernel/config; }
mount_scratch() {
    # Backing files live on tmpfs (the spec's namespaces use buffered_io: tmpfs has no
    # O_DIRECT). The host's root is read-only here, so tests get a tmpfs TMPDIR too.
    mkdir -p $BACKING /run/tierkv-rig-tmp &&
    mount -t tmpfs -o size=768M tierkv-rig $BACKING &&
    mount -t tmpfs -o size=256M tierkv-rig-tmp /run/tierkv-rig-tmp
}

phase boot
step modules modprobe -a configfs nvmet nvmet-rdma nvmet-tcp rdma_rxe ib_uverbs rdma_ucm \
    nvme-fabrics nvme-rdma nvme-tcp dummy
step configfs mount_configfs
step rxe bring_up_rxe
step scratch mount_scratch
export TIERKV_RIG_GUEST=1 TIERKV_RIG_OUT="$OUT" TMPDIR=/run/tierkv-rig-tmp
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONDONTWRITEBYTECODE=1
cd "$REPO"

if [ "$MODE" = check ]; then
    rdma link show; ibv_devices
    ls /sys/kernel/config/nvmet
    # Opt-in (about 100 s under TCG, nearly all of it torch): TIERKV_RIG_TIME_IMPORT=1.
    [ "${TIERKV_RIG_TIME_IMPORT:-0}" = 1 ] && step import_tierkv_api "$PY" -c 'import tierkv.store.api'
    if [ -f "$REPO/tierkv/doctor.py" ]; then
        "$PY" -m tierkv doctor --json > "$OUT/doctor.json" || echo "!!! tierkv doctor exited $?"
        phase doctor
    fi
    finish 0
fi

# No test path among the arguments (an existing file or folder, relative or absolute,
# with or without a ::node suffix; not the value of an option such as -k): run the
# whole rig suite. With one, run only what was asked.
has_path=0 skip=0
for arg in "$@"; do
    if [ $skip = 1 ]; then skip=0; continue; fi
    case $arg in
        -k|-m|-p|-o|-c|-W|--deselect|--ignore|--rootdir|--junitxml|--confcutdir) skip=1; continue ;;
        -*) continue ;;
    esac
    [ -e "${arg%%::*}" ] && { has_path=1; break; }
done
[ $has_path = 1 ] || set -- tests/rig "$@"
# --confcutdir: tests/conftest.py imports torch (about 100 s under TCG); rig tests that
# need the store import it themselves.
"$PY" -m pytest -m rig -p no:cacheprovider --confcutdir=tests/rig --junitxml="$OUT/junit.xml" "$@"
rc=$?
phase pytest
nvme disconnect-all >/dev/null 2>&1   # a test that died mid-way may leave a controller behind
finish $rc
