"""How a store opens: the writer lock, the tiers a config asks for, the index with its
geometry record, the data-file label (whose medium it is: :mod:`tierkv.store.medium`),
and the adoption of persistent pages.

:func:`open_store_parts` returns everything :class:`tierkv.store.api.Store` runs on; on any
failure it closes what it opened. Called once per ``Store.open``.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import xxhash

from tierkv.codec import Codec, CodecMode
from tierkv.config import NvmeConfig, NvmeofConfig, StoreConfig
from tierkv.errors import ConfigError, StoreBusyError
from tierkv.store.index import PersistentIndex, is_damage, open_index, quarantine_index
from tierkv.store.index_runs import live_records
from tierkv.store.index_check import mark_clean
from tierkv.store.resident import trim_heap
from tierkv.store.manager import BlockManager
# The data-file label's format, and what is on a medium before a store takes it.
from tierkv.store.medium import LABEL_BYTES, LABEL_MAGIC, Contents, Medium, examine, label_data_bytes, owner_record
from tierkv.policy import make_policy
from tierkv.store.coding import CodecChoice
from tierkv.tiers.aligned import ALIGN, round_up
from tierkv.tiers.base import Tier, TierKind
from tierkv.tiers.blocks import BlockPageTier
from tierkv.tiers.dram import DramTier
from tierkv.tiers.fabric import open_nvmeof_tier
from tierkv.tiers.nvme import NvmeTier
from tierkv.tiers.nvmeof import NvmeofTier

#: Pages adopted at open past which the C heap is trimmed afterwards (see ``tierkv.store.resident.trim_heap``).
_TRIM_AFTER = 1 << 16

# 3: records of block-addressed tiers carry extents (format 2 stores open unchanged:
# their records are slot records, byte for byte).
# 4: slot tiers' records are written as runs, one per commit (tierkv.store.index_runs);
# a writer carries a format 2 or 3 store's per-key records into runs when it opens it.
FORMAT_VERSION = 4
UPGRADABLE_FORMATS = (2, 3)
_OLD_IMAGE = "index.image"   # format 3's image of a clean close's records
log = logging.getLogger(__name__)


@dataclass
class StoreParts:
    """What an open store holds: the writer lock's fd (None for readers), the index, the manager."""

    lock_fd: int | None
    index: PersistentIndex | None
    manager: BlockManager


def open_store_parts(cfg: StoreConfig, read_only: bool) -> StoreParts:
    """Lock the directory, build the tiers, open and check the index, adopt persistent pages.

    An index found damaged while adopting is set aside (logged) and the store opens
    empty instead; any other failure releases everything and propagates.
    """
    store_dir = Path(cfg.path)
    lock_fd = acquire_dir(store_dir, read_only)
    try:
        try:
            index, manager = _open_tiers(cfg, read_only)
        except BaseException as exc:
            if read_only or not is_damage(exc):
                raise
            quarantine_index(store_dir, str(exc))
            index, manager = _open_tiers(cfg, read_only)
    except BaseException:
        release_dir(lock_fd)
        raise
    return StoreParts(lock_fd, index, manager)


def acquire_dir(store_dir: Path, read_only: bool) -> int | None:
    """Create the store directory (0700) and take its writer lock; readers take none."""
    if read_only:
        if not store_dir.is_dir():
            raise ConfigError(f"no store at {store_dir}; a read-only open needs an existing store")
        return None
    try:
        store_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create the store directory {store_dir}: {exc}") from None
    fd = os.open(store_dir / "writer.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        served = _served_on(store_dir, holder)
        if served is not None:
            raise StoreBusyError(f"the store at {store_dir} is served by a tierkv serve daemon (pid {holder}); "
                                 f"use it through Store.connect({served!r})") from None
        raise StoreBusyError(f"the store at {store_dir} is open for writing by pid {holder}; "
                             "open it with read_only=True to share it") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


#: Written by a ``tierkv serve`` daemon into the store's directory while it serves: its pid
#: and socket, so that a second open can say where to connect instead.
SERVED_FILE = "serve.socket"


def _served_on(store_dir: Path, holder: str) -> str | None:
    """The socket of the daemon ``holder`` (a pid), if that daemon serves this store."""
    try:
        pid, _, sock = (store_dir / SERVED_FILE).read_text().partition("\n")
    except (OSError, UnicodeDecodeError):
        return None
    return sock.strip() if pid.strip() == holder and sock.strip() else None


def release_dir(lock_fd: int | None) -> None:
    if lock_fd is not None:
        os.close(lock_fd)  # closing drops the flock


def _open_tiers(cfg: StoreConfig, read_only: bool) -> tuple[PersistentIndex | None, BlockManager]:
    tiers = build_tiers(cfg, read_only)
    index: PersistentIndex | None = None
    created: Path | None = None         # an index this open made: removed again if the open fails
    try:
        persistent: list[str] = [t.name for t in tiers if t.persistent]
        if persistent:
            store_dir = Path(cfg.path)
            if not read_only and not (store_dir / "index.lmdb").exists():
                created = store_dir / "index.lmdb"
            try:
                index = open_index(store_dir, persistent, _meta(cfg, tiers), read_only=read_only,
                                   verify=cfg.verify_index, upgrade_from=UPGRADABLE_FORMATS,
                                   runs=[t.name for t in tiers if t.persistent and not t.block_addressed])
            except ConfigError as exc:
                raise _with_resize_hint(cfg, exc) from None
            if not read_only:
                # A clean close of format 3 left an image of its records; runs need none.
                (store_dir / _OLD_IMAGE).unlink(missing_ok=True)
                mark_clean(store_dir, False)
            for t in tiers:
                medium = t.blocks if isinstance(t, BlockPageTier) else t
                if isinstance(medium, NvmeTier):  # the index accepted this geometry: now check whose medium it is
                    _check_label(medium, index, read_only, store_dir, _may_format(cfg, medium))
        manager = BlockManager(tiers, {t.name: make_policy(cfg.policy) for t in tiers}, index)
        if not read_only:
            adopted = sum(manager.adopt_persistent(t.name) for t in tiers if t.persistent)
            if adopted >= _TRIM_AFTER:
                trim_heap()
            if index is not None and cfg.durability == "window":  # adoption's deletes are committed already
                index.group_commit({t.name: _syncer(t) for t in tiers if t.persistent},
                                   window_s=cfg.commit_window_s, max_pages=cfg.commit_window_pages)
        return index, manager
    except BaseException:
        for t in tiers:
            t.close()
        if index is not None:
            index.close()
        if created is not None:         # a refused open leaves no geometry behind for the next one
            shutil.rmtree(created, ignore_errors=True)
        raise


def _syncer(tier: Tier) -> Callable[[], None]:
    """The group commit's data sync for ``tier``: its ``flush``, looked up at each call."""
    return lambda: tier.flush()


def build_tiers(cfg: StoreConfig, read_only: bool) -> list[Tier]:
    """The tiers ``cfg`` asks for, fastest first (one per entry of :data:`TIER_BUILDERS`);
    readers get the persistent ones only (a reader of an NVMe-oF tier uses the namespace
    where it is connected, never connects). On failure the tiers built so far are closed."""
    tiers: list[Tier] = []
    try:
        for build in TIER_BUILDERS.values():
            tier = build(cfg, read_only)
            if tier is not None:
                tiers.append(tier)
    except BaseException:
        for t in tiers:  # a later tier failed: release the memory and files of earlier ones
            t.close()
        raise
    if not tiers:
        raise ConfigError("a read-only open needs the store's NVMe tier configured" if read_only
                          else "every tier of this store has zero capacity")
    return tiers


def _hbm(cfg: StoreConfig, read_only: bool) -> Tier | None:
    if cfg.hbm is None or not cfg.hbm.capacity_bytes or read_only:
        return None
    pb = cfg.layout.page_bytes
    slots = cfg.hbm.capacity_bytes // pb
    if slots == 0:
        raise ConfigError(f"hbm capacity of {cfg.hbm.capacity_bytes} bytes holds no page of {pb} bytes")
    from tierkv.tiers.hbm import HbmTier  # torch loads only for stores with an HBM tier

    return HbmTier(slots, pb, device=cfg.hbm.device)


def _dram(cfg: StoreConfig, read_only: bool) -> Tier | None:
    if cfg.dram is None or read_only:
        return None
    pb = cfg.layout.page_bytes
    slots = cfg.dram.capacity_bytes // pb
    if slots == 0 and cfg.dram.capacity_bytes:
        raise ConfigError(f"dram capacity of {cfg.dram.capacity_bytes} bytes holds no page of {pb} bytes")
    return DramTier(slots, pb, prefault=cfg.dram.prefault, copy_threads=cfg.dram.copy_threads or None) if slots else None


def _nvme(cfg: StoreConfig, read_only: bool) -> Tier | None:
    if cfg.nvme is None:
        return None
    nvme = cfg.nvme
    slot_bytes = round_up(cfg.layout.page_bytes)
    slots = nvme.capacity_bytes // slot_bytes
    if slots == 0:
        raise ConfigError(f"nvme capacity of {nvme.capacity_bytes} bytes holds no slot of {slot_bytes} bytes")
    if read_only or not nvme.format:  # before the file is opened (and its size judged) at all
        found = examine(cfg.nvme_path())
        if found.contents is Contents.FOREIGN:
            raise ConfigError(f"{found.path} does not belong to the store index beside it ({found.describe()})"
                              if read_only else _not_ours(found, "nvme"))
    return _paged(cfg, nvme, lambda unit: NvmeTier(
        cfg.nvme_path(), slots * (slot_bytes // round_up(unit)), unit, o_direct=nvme.o_direct,
        io_threads=nvme.io_threads, create=not read_only, header_bytes=LABEL_BYTES, defer_grow=True,
        exclusive=not read_only, io_uring=nvme.io_uring))


def _nvmeof(cfg: StoreConfig, read_only: bool) -> Tier | None:
    if cfg.nvmeof is None:
        return None
    nvmeof = cfg.nvmeof
    return _paged(cfg, nvmeof, lambda unit: open_nvmeof_tier(
        nvmeof, unit, header_bytes=LABEL_BYTES, connect=not read_only, labelled_bytes=label_data_bytes))


# One builder per tier kind, fastest first: each builds its tier from the config, or
# returns None where the config has none (or a reader does not open that kind).
TIER_BUILDERS: dict[TierKind, Callable[[StoreConfig, bool], Tier | None]] = {
    TierKind.HBM: _hbm,
    TierKind.DRAM: _dram,
    TierKind.NVME: _nvme,
    TierKind.NVMEOF: _nvmeof,
}


def _paged(cfg: StoreConfig, tier_cfg: NvmeConfig | NvmeofConfig, medium: Callable[[int], NvmeTier]) -> Tier:
    """A file or namespace tier: ``medium(unit)`` opens it in slots of ``unit`` bytes. With
    ``codec = "none"`` its slots are pages; otherwise the same medium in 4 KiB blocks under
    a :class:`BlockPageTier` that codes as ``tier_cfg.codec`` says (for readers too: they
    read each page at the extents its index record names, BlockPageTier.view)."""
    pb = cfg.layout.page_bytes
    if tier_cfg.codec == CodecMode.NONE.value:
        return medium(pb)
    blocks = medium(ALIGN)
    return _block_tier(blocks, blocks.num_slots // (round_up(pb) // ALIGN), cfg, tier_cfg)


def _block_tier(blocks: NvmeTier, pages: int, cfg: StoreConfig, tier_cfg: NvmeConfig | NvmeofConfig) -> BlockPageTier:
    """Pages over a tier opened with 4 KiB slots, coded as ``tier_cfg.codec`` says."""
    try:
        if pages == 0:
            raise ConfigError(f"{blocks.kind.value} capacity holds no page of {cfg.layout.page_bytes} bytes")
        codec = Codec(cfg.layout, threads=max(1, min(tier_cfg.io_threads, os.cpu_count() or 1)))
        choice = CodecChoice(CodecMode.parse(tier_cfg.codec), codec, tier_cfg.bandwidth_gbps)
        return BlockPageTier(blocks, pages, cfg.layout.page_bytes, choice)
    except BaseException:
        blocks.close()
        raise


def _check_label(tier: NvmeTier, index: PersistentIndex, read_only: bool, store_dir: Path,
                 may_format: bool) -> None:
    """Make sure the data file or namespace belongs to this index, and label it when it may be taken.

    Nothing is written (a short file is not grown) before this decides. This store's label:
    kept (rewritten by a writer when its owner record is missing or out of date). Readers
    accept nothing else. A writer labels a missing, empty or blank medium, or one marked by
    ``tierkv format`` (records this store held for it are dropped); foreign data (a
    signature, non-zero bytes: :func:`tierkv.store.medium.examine`) only with ``format =
    true`` in the tier's config, else ConfigError and nothing changed. Another store's
    label is refused with ConfigError, index included, whatever ``format`` says. The one
    tierkv label that is taken is an earlier store's in this same directory on this host
    whose index was lost (or one from before labels had owner records): only by an index
    that has never labelled this tier's medium. An index that has (its identity on its own
    medium) meeting another identity here is another store under the same host name and
    path (another container), or an index restored from before its medium was relabelled:
    refused too.
    """
    ident = LABEL_MAGIC + index.store_id()
    name = tier.name
    owner = _owner_of(store_dir, tier.num_slots * tier.slot_bytes, LABEL_BYTES - len(ident))
    label = ident + json.dumps(owner, sort_keys=True).encode() + b"\0"
    if isinstance(tier, NvmeofTier):
        tier.expect_header(ident)  # recovery after a fabric loss requires this identity back
    found = examine(tier.path)
    if found.head.startswith(ident):
        if not read_only:
            tier.grow_back()
            if not found.head.startswith(label):
                tier.write_header(label)
            index.mark_labelled(name)
        return
    if read_only:
        raise ConfigError(f"{tier.path} does not belong to the store index beside it")
    if found.contents is Contents.TIERKV:
        _refuse_other_store(found, tier, index, owner)
        log.warning("%s carries the label of an earlier store in %s (its index was lost); labelling it for "
                    "this one", tier.path, owner["path"])
    elif found.contents is Contents.FOREIGN:
        if not may_format:
            raise ConfigError(_not_ours(found, tier.kind.value))
        log.warning("%s holds %s; [tiers.%s] format = true: taking it over", tier.path, found.describe(),
                    tier.kind.value)
    stale = index.entries(name) + (len(live_records(index, name)) if index.has_runs(name) else 0)
    if stale:
        log.warning("%s carries no label of this store (%s); its %d index records are dropped and those pages "
                    "become misses", tier.path, found.contents.value, stale)
        index.clear(name)
    tier.grow_back()
    tier.write_header(label)
    index.mark_labelled(name)


def _refuse_other_store(found: Medium, tier: NvmeTier, index: PersistentIndex, owner: dict[str, object]) -> None:
    """ConfigError unless ``found``'s tierkv label is an earlier store's of this directory
    on this host (or an owner-less old one) and this index has never labelled ``tier``."""
    theirs = owner_record(found.head)    # {}: a label from before owner records
    here = (theirs.get("host"), theirs.get("path")) == (owner["host"], owner["path"])
    labelled = index.has_labelled(tier.name)
    if not ((theirs and not here) or labelled):
        return
    who = (f"the store at {theirs.get('path')} on host {theirs.get('host')}" if theirs
           else "a store labelled before labels named their owner")
    if labelled and (here or not theirs):
        who += (", with another identity than this store's index, which has labelled a medium of its own: "
                "another container with the same host name and path, or an index restored from before this "
                "medium was relabelled")
    raise ConfigError(
        f"{tier.path} belongs to another tierkv store ({who}); refusing to relabel it for the store at "
        f"{owner['path']}: point [tiers.{tier.kind.value}] at this store's own medium, or hand this one over "
        f"with 'tierkv format {tier.path} --yes' (format = true does not take another store's label)")


def _not_ours(found: Medium, kind: str) -> str:
    """The one-line refusal of a medium holding data that is not a store's."""
    return (f"[tiers.{kind}] {'device' if kind == 'nvmeof' else 'path'} {found.path} holds data that is not this "
            f"store's ({found.describe()}); refusing to take it over. Point it at a new file or a blank device, "
            f"or, if its contents may be destroyed, run 'tierkv format {found.path}' (shows what is there; --yes "
            f"erases it) or set format = true in [tiers.{kind}]")


def _may_format(cfg: StoreConfig, tier: NvmeTier) -> bool:
    """Whether the config lets ``tier`` take a medium holding foreign data (``format = true``)."""
    tier_cfg = cfg.nvmeof if isinstance(tier, NvmeofTier) else cfg.nvme
    return tier_cfg is not None and tier_cfg.format


def _owner_of(store_dir: Path, data_bytes: int, room: int) -> dict[str, object]:
    """This store's owner record as the label holds it: host, store directory and data
    bytes, within ``room`` bytes of JSON and a NUL (a path too long for that, as escaped
    JSON, is named by its digest, and so compared)."""
    path = os.fsdecode(os.path.realpath(store_dir))
    owner: dict[str, object] = {"host": socket.gethostname()[:255], "path": path, "data_bytes": data_bytes}
    if len(json.dumps(owner, sort_keys=True).encode()) + 1 > room:
        owner["path"] = "xxh3:" + xxhash.xxh3_128_hexdigest(path.encode(errors="surrogateescape"))
    return owner


def _with_resize_hint(cfg: StoreConfig, exc: ConfigError) -> ConfigError:
    """A geometry refusal caused by a namespace that changed size under ``capacity_bytes = 0``
    (a store labelled before labels recorded their size) says what to do about it."""
    if cfg.nvmeof is None or cfg.nvmeof.capacity_bytes or "nvmeof_slots" not in str(exc):
        return exc
    return ConfigError(f"{exc}. [tiers.nvmeof] capacity_bytes = 0 sizes the tier by its namespace, which has "
                       "changed size since: set capacity_bytes to the size the store was created with")


def _meta(cfg: StoreConfig, tiers: list[Tier]) -> dict[str, object]:
    """The geometry a store is created with; reopening with another is refused."""
    meta: dict[str, object] = {"format": FORMAT_VERSION, "layout": cfg.layout.fingerprint().decode()}
    for t in tiers:
        if t.persistent:
            meta[f"{t.name}_slots"] = t.num_slots   # named after the tier: a kind's name by default, as
            meta[f"{t.name}_slot_bytes"] = t.slot_bytes  # every store written before tiers had names
    return meta
