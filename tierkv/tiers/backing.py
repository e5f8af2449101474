"""Opening the backing medium of a file-backed tier: a 0600 file or a block device.

``open_backing`` creates the file sparse at the tier's size (or checks an existing one,
or a block device, against it) and opens it with O_DIRECT where the filesystem allows
it; the tier allocates a file's disk space as it fills (:mod:`tierkv.tiers.nvme`). Used
by :mod:`tierkv.tiers.nvme` and :mod:`tierkv.tiers.nvmeof`.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat

from tierkv.errors import ConfigError, TierIOError

logger = logging.getLogger("tierkv.tiers.nvme")


def open_backing(path: str, size: int, *, o_direct: bool, create: bool) -> tuple[int, bool, int | None]:
    """Create or check the backing file, then open it; returns ``(fd, direct, short)``,
    ``short`` the size of an existing file shorter than ``size`` (to grow back), else None."""
    short: int | None = None
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if not create:
            raise ConfigError(f"nvme tier file {path} does not exist and create=False") from None
        _create_file(path, size)
    else:
        if _check_existing(path, st, size, grow=create):
            short = st.st_size
    flags = os.O_RDWR | os.O_CLOEXEC
    if o_direct:
        try:
            return os.open(path, flags | os.O_DIRECT), True, short
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise TierIOError(f"nvme tier {path}: cannot open with O_DIRECT: {oserr(e)}") from e
            logger.warning("nvme tier %s: the filesystem refuses O_DIRECT (%s); using buffered I/O,"
                           " so reads may come from the page cache", path, os.strerror(e.errno))
    try:
        return os.open(path, flags), False, short
    except OSError as e:
        raise TierIOError(f"nvme tier {path}: cannot open: {oserr(e)}") from e


def _create_file(path: str, size: int) -> None:
    """Create ``path`` with mode 0600, ``size`` bytes long and sparse; no file on failure.
    Its disk space is allocated as the tier writes it; a size past the free space is
    allowed (the cache may never fill), with a warning."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise TierIOError(f"nvme tier {path}: cannot create: {oserr(e)}") from e
    try:
        os.fchmod(fd, 0o600)  # the umask could have taken the owner's write bit
        os.ftruncate(fd, size)
    except OSError as e:
        os.close(fd)
        os.unlink(path)
        raise TierIOError(f"nvme tier {path}: cannot make it {size} bytes long: {oserr(e)}") from e
    os.close(fd)
    free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
    if size > free:
        logger.warning("nvme tier %s: %d bytes, more than the %d free on its filesystem; once the disk is "
                       "full, writes of new pages fail (those pages are not stored)", path, size, free)


def _check_existing(path: str, st: os.stat_result, size: int, *, grow: bool) -> bool:
    """An existing file must be exactly ``size`` bytes; a block device at least that.

    A file that is too short (truncated) may be grown back when ``grow`` is set: returns
    True for it (the caller grows it, :meth:`NvmeTier.grow_back`), False when it fits.
    """
    if stat.S_ISBLK(st.st_mode):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            have = os.lseek(fd, 0, os.SEEK_END)
        finally:
            os.close(fd)
        if have < size:
            raise ConfigError(f"nvme tier block device {path} holds {have} bytes, the tier needs {size}")
    elif stat.S_ISREG(st.st_mode):
        if st.st_size < size and grow:
            return True
        if st.st_size != size:
            raise ConfigError(f"nvme tier file {path} is {st.st_size} bytes, the tier needs exactly {size}"
                              " (num_slots * slot_bytes); remove it or open it with its own geometry")
    else:
        raise ConfigError(f"nvme tier path {path} is neither a regular file nor a block device")
    return False


def oserr(e: OSError) -> str:
    return f"[Errno {e.errno}] {os.strerror(e.errno)}" if e.errno is not None else str(e)
