"""The connector's worker half, without vLLM: loads and saves pages, layer by layer.

Runs in each vLLM worker process over its own connections to the node's ``tierkv serve``
daemon. Pages cross between the daemon and this process through shared memory: buffers
of this process's (:meth:`~tierkv.serve.client.RemoteStore.page_buffer`), which the
daemon fills or reads, or, for loads from DRAM, the daemon's own pool, lent in place.
This process copies a page between that memory and vLLM's blocks once, permuting to and
from the store's page order (:class:`~tierkv.integrations.vllm.blocks.CpuPagedKV`).

- Loads: when the scheduler announces a job (:meth:`ConnectorWorker.start_early`, over
  :mod:`tierkv.integrations.vllm.early`, milliseconds before the step), or else when the
  step begins (:meth:`ConnectorWorker.begin_step`, vLLM binding the plan), a background
  thread serves it: when the daemon holds all its pages in DRAM
  they are lent in place (the worker maps the daemon's DRAM tier read-only,
  ``RemoteStore.dram_pool``, and copies from it; the daemon copies nothing); otherwise a
  layered get (``get(..., landed=record)``) has the daemon fill a page buffer a group of
  layers at a time, announcing each in the job's landing record. :meth:`wait_layer`
  (vLLM's ``wait_for_layer_load``, on entry to each attention layer) waits until that
  layer has landed and copies it into vLLM's blocks, on vLLM's own thread: on a CPU
  engine a second copying thread competes with the forward pass's OpenMP threads for the
  same cores and made loads slower (docs/benchmarks.md). A page the store does not
  return (evicted, or it failed its checksum, possibly after its first layers were
  announced and copied) leaves its block in :meth:`load_errors`, which vLLM recomputes
  (``kv_load_failure_policy="recompute"``, the step's output for the request dropped);
  nothing unverified is kept.
- Saves: :meth:`save_layer` copies a layer of each saved block into a buffer right
  after the forward pass wrote it; :meth:`end_step` copies any layer not seen yet
  (vLLM skipped the hook) and hands the buffer to a background thread that puts it.
  The blocks are free for vLLM to reuse as soon as the step ends.

Buffers come from a pool of ``buffers`` (bounded memory). A job that finds none free
waits for a background put to return one; when no put is running (this step's own jobs
hold them all), a load is left to vLLM to recompute and a save is skipped, both
counted. Failures are logged and counted, never raised into vLLM.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from tierkv.errors import TierKVError
from tierkv.integrations.vllm.blocks import CpuPagedKV, runs
from tierkv.integrations.vllm.plan import LoadJob, SaveJob, StepPlan, store_accept
from tierkv.serve.client import RemoteStore
from tierkv.store import landed
from tierkv.store.results import Lent

log = logging.getLogger(__name__)

#: Seconds between looks at a landing record once the first quick ones found nothing.
POLL_S = 0.0002

#: Page buffers the worker keeps, each as many pages as the engine's longest context
#: (made when the worker starts, so that no request waits for one to be made).
DEFAULT_BUFFERS = 4


@dataclass
class WorkerCounters:
    """What this worker did (tokens are engine tokens, whole pages)."""

    loaded_tokens: int = 0
    failed_load_tokens: int = 0
    saved_pages: int = 0
    failed_saves: int = 0
    skipped_saves: int = 0
    lent_tokens: int = 0           # of loaded_tokens: copied straight out of the daemon's DRAM
    get_seconds: float = 0.0       # waiting for the daemon's gets
    scatter_seconds: float = 0.0   # copying loaded pages into vLLM's blocks, waits included
    wait_seconds: float = 0.0      # of scatter_seconds: waiting for layers to land
    early_loads: int = 0           # loads their plan took already started from the scheduler's note
    unused_early_loads: int = 0    # loads started from a note that no plan took (given back unused)
    late_announcements: int = 0    # the scheduler's notes that came after their plan (ignored)
    announce_seconds: float = 0.0  # from the scheduler's notes to this worker hearing them, summed
    tokens_by_tier: dict[str, int] = field(default_factory=dict)


@dataclass(eq=False)
class _Load:
    """One job's load in this step: its buffer, landing record and how far it got."""

    job: LoadJob
    buf: np.ndarray
    record: np.ndarray
    pages: torch.Tensor        # ``buf`` as pages
    upto: int = 0              # pages copied for every layer copied so far (from job.skip)
    served: int | None = None  # the get's count, once it returned
    lent: Lent | None = None   # the pages lent in place from the daemon's DRAM, instead of a get
    pool: torch.Tensor | None = None   # the mapping of the daemon's pool the lent rows are in
    future: Future[None] | None = None   # the loader's task that lends or gets the pages
    tiers: list[str] = field(default_factory=list)   # where each served page came from


class _BufferPool:
    """Page buffers in the daemon's shared memory, each ``pages`` rows; lent one at a time."""

    def __init__(self, store: RemoteStore, pages: int, count: int) -> None:
        self._store, self._pages = store, pages
        self._free: list[np.ndarray] = []
        self._made = 0
        self._count = count
        self._records: dict[int, np.ndarray] = {}
        self._cond = threading.Condition()

    def record(self, buf: np.ndarray) -> np.ndarray:
        """The landing record that goes with ``buf`` (made with it, on first use)."""
        key = buf.__array_interface__["data"][0]
        with self._cond:
            rec = self._records.get(key)
        if rec is None:
            rec = self._store.landing_record()
            with self._cond:
                rec = self._records.setdefault(key, rec)
        return rec

    def spare(self, keep: int) -> np.ndarray | None:
        """A free buffer if more than ``keep`` are free (made ones), else None; never waits."""
        with self._cond:
            if len(self._free) > keep:
                return self._free.pop()
        return None

    def take(self, may_wait: Callable[[], bool]) -> np.ndarray | None:
        """A free buffer; when none is, wait while ``may_wait()`` (someone will give one
        back), else None."""
        with self._cond:
            while not self._free and self._made >= self._count:
                if not may_wait():
                    return None
                self._cond.wait(0.05)
            if self._free:
                return self._free.pop()
            self._made += 1
        try:
            return self._store.page_buffer(self._pages)
        except BaseException:
            with self._cond:
                self._made -= 1
                self._cond.notify()
            raise

    def fill(self) -> None:
        """Make every buffer now."""
        while self._made < self._count:
            buf = self._store.page_buffer(self._pages)
            with self._cond:
                self._made += 1
                self._free.append(buf)

    def attach(self) -> None:
        """Register every buffer with the daemon on the calling thread's connection."""
        with self._cond:
            bufs = list(self._free)
        for buf in bufs:
            self._store.attach_buffer(buf)
            self._store.attach_buffer(self.record(buf))

    def give(self, buf: np.ndarray) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify()


class ConnectorWorker:
    """The worker half over one connection and one worker's KV caches."""

    def __init__(self, store: RemoteStore, kv: CpuPagedKV, max_pages: int, *, buffers: int = DEFAULT_BUFFERS) -> None:
        self.store = store
        self.kv = kv
        self.max_pages = max_pages
        self.counters = WorkerCounters()
        self._pool = _BufferPool(store, max_pages, max(buffers, 2))
        self._pool.fill()
        self._dram_rows: np.ndarray | None = None   # the daemon's pool as mapped, under self._dram
        self._dram = self._map_dram()
        self._puts = 0   # puts handed to the background, not yet returned
        self._layers = len(kv.layers)
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierkv-vllm-load")
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierkv-vllm-save")
        # The daemon maps every buffer on both threads' connections now, not during a request.
        for pool in (self._loader, self._saver):
            pool.submit(self._pool.attach).result()
        self._lock = threading.Lock()
        self._errors: set[int] = set()
        self._loads: list[_Load] = []   # this step's loads, until their buffers go back
        # Loads started before their plan (start_early), by serial, until a plan takes them
        # or passes them by; plans seen so far name serials up to _bound.
        self._early: dict[int, _Load] = {}
        self._bound = 0
        self._origin = 0   # the planner's (from its plans): notes of another are ignored
        self._early_lock = threading.Lock()
        self._copied = 0   # layers of this step's loads copied into vLLM's blocks
        self._step_errors: set[int] = set()   # blocks whose load failed in this step
        # Per request: leading pages known to be in the store (loaded, or put), and puts
        # still running. A save starts from the first page not known stored.
        self._confirmed: dict[str, int] = {}
        self._inflight: dict[str, int] = {}
        self._gone: set[str] = set()   # finished requests with puts still running
        self._saving: list[tuple[SaveJob, int, np.ndarray, torch.Tensor, set[int]]] = []

    # -- a step ---------------------------------------------------------------------------
    def begin_step(self, plan: StepPlan) -> None:
        """vLLM bound this step's plan (before the forward pass): take the loads started
        early for it, take buffers for the others and start their gets, then take buffers
        for its saves. A load with no buffer is recomputed; a save with none is skipped."""
        self._finish_layers()   # a step that never reached its copies (none in vLLM's order)
        self._step_errors = set()
        with self._early_lock:
            if plan.origin and plan.origin != self._origin:   # the first plan, or the planner restarted
                self._origin, self._bound = plan.origin, 0
            self._bound = max(self._bound, plan.serial, max((j.serial for j in plan.loads), default=0))
            early = {j.serial: self._early.pop(j.serial) for j in plan.loads
                     if j.serial in self._early and self._early[j.serial].job.origin == j.origin}
            passed = [s for s, e in self._early.items() if s <= self._bound or e.job.origin != self._origin]
            stale = [self._early.pop(s) for s in passed]
        for load in stale:   # announced, then not planned: never copied
            log.info("tierkv: an early load for %s was not in its plan; giving it back", load.job.req_id)
            self._loader.submit(self._drop_early, load)
        with self._lock:
            self.counters.unused_early_loads += len(stale)
        started: list[_Load] = []
        loading = []
        for job in plan.loads:
            pre = early.pop(job.serial, None)
            if pre is not None and pre.job.same(job):
                started.append(pre)
                with self._lock:
                    self.counters.early_loads += 1
                continue
            if pre is not None:   # announced differently from the plan: the plan is the truth
                log.warning("tierkv: the early load %d for %s differs from its plan; loading as planned",
                            job.serial, job.req_id)
                self._loader.submit(self._drop_early, pre)
                with self._lock:
                    self.counters.unused_early_loads += 1
            buf = self._pool.take(self._putting) if job.end <= self.max_pages else None
            if buf is None:
                log.warning("tierkv: no page buffer for %s's load of %d pages; vLLM recomputes them",
                            job.req_id, len(job.block_ids))
                self._fail_load(job, 0)
                continue
            loading.append((job, buf))
        self._copied = 0
        fresh = [self._new_load(job, buf) for job, buf in loading]
        if fresh:
            fut = self._loader.submit(self._get_all, fresh)
            for load in fresh:
                load.future = fut
        self._loads = started + fresh
        self._saving = []
        for sjob in plan.saves:
            with self._lock:
                known = self._confirmed.get(sjob.req_id)
                start = sjob.first if known is None or self._inflight.get(sjob.req_id) else min(known, sjob.first)
            buf = self._pool.take(self._putting) if sjob.end <= self.max_pages else None
            if buf is None:
                log.warning("tierkv: no page buffer for %s's save of %d pages; they are not stored",
                            sjob.req_id, sjob.end - start)
                self._saved(sjob.req_id, min(start, known if known is not None else start))
                with self._lock:
                    self.counters.skipped_saves += 1
                continue
            self._saving.append((sjob, start, buf, self.kv.pages(torch.from_numpy(buf)), set()))

    # -- loads ------------------------------------------------------------------------
    def start_load(self) -> None:
        """vLLM's ``start_load_kv``: the gets started when the step began; nothing to add."""

    def _new_load(self, job: LoadJob, buf: np.ndarray) -> _Load:
        load = _Load(job, buf, self._pool.record(buf), self.kv.pages(torch.from_numpy(buf)))
        landed.reset(load.record)
        return load

    def start_early(self, job: LoadJob, sent: float | None = None) -> bool:
        """The scheduler announced ``job`` before its plan (:mod:`tierkv.integrations.vllm.early`;
        any thread; ``sent``: when, ``time.monotonic()``): start its lend or get now, into a
        buffer free now, for the plan to take. False (nothing started) when a plan already
        named it, or no buffer is free."""
        with self._lock:
            if sent is not None:
                self.counters.announce_seconds += max(0.0, time.monotonic() - sent)
        with self._early_lock:
            if self._origin and job.origin != self._origin:
                log.debug("tierkv: ignoring a note of another planner (%x, not %x)", job.origin, self._origin)
                return False
            if job.serial <= self._bound or job.serial in self._early:
                with self._lock:
                    self.counters.late_announcements += job.serial <= self._bound
                return False
        # One buffer stays for the step that binds next (its own loads and saves).
        buf = self._pool.spare(keep=1) if job.end <= self.max_pages else None
        if buf is None:
            return False
        try:
            load = self._new_load(job, buf)
            with self._early_lock:
                if job.serial > self._bound and job.serial not in self._early and (
                        not self._origin or job.origin == self._origin):
                    self._early[job.serial] = load
                    load.future = self._loader.submit(self._get_all, [load])
                    buf = None
                    return True
            return False
        finally:
            if buf is not None:
                self._pool.give(buf)

    def _drop_early(self, load: _Load) -> None:
        """On the loader's thread, after ``load``'s own task: an early load no plan took
        gives its lent rows and buffer back."""
        if load.lent is not None:
            self._end_lend(load.lent)
        self._pool.give(load.buf)

    def _map_dram(self) -> torch.Tensor | None:
        """The daemon's DRAM tier as pages, mapped here read-only, so that a load whose pages
        all lie there copies them straight into vLLM's blocks (one copy instead of two, and
        none in the daemon competing with the forward pass for the cores); None where the
        daemon does not lend (a user limited to some tenants, a page-locked pool)."""
        try:
            pool = self.store.dram_pool()
        except TierKVError as exc:
            log.info("tierkv: loads go through the daemon's gets (%s)", exc)
            return None
        self._dram_rows = pool
        with warnings.catch_warnings():   # read-only memory, only ever read from
            warnings.simplefilter("ignore", UserWarning)
            return self.kv.pages(torch.from_numpy(pool))

    def _get_all(self, loads: list[_Load]) -> None:
        """The background half of a load: pages lent in place where the daemon holds them
        all in DRAM; else the daemon reads each job's pages into its buffer a layer at a
        time, announcing each layer in the job's landing record."""
        t0 = time.perf_counter()
        for load in loads:
            if self._dram is not None and load.job.lend and self._lend(load):
                continue
            load.served = self._get(load)
        with self._lock:
            self.counters.get_seconds += time.perf_counter() - t0

    def wait_layer(self, layer: int) -> None:
        """vLLM's attention for ``layer`` is about to read the blocks: copy that layer (and
        any before it not copied yet) of the loaded pages into them, each as soon as the
        daemon announces it landed (on vLLM's thread, so the copies use its OpenMP threads
        instead of competing with them for the same cores)."""
        if not self._loads:
            return
        self._copy_layers(layer + 1)

    def _resolve(self) -> list[_Load]:
        """This step's gets, waited for (all of them, so that no buffer goes back while the
        daemon still writes it). A task that failed in a way ``_get`` did not catch fails
        the loads it served (their blocks recomputed, their buffers given back)."""
        futures = {id(load.future): load.future for load in self._loads if load.future is not None}
        failed = set()
        for key, fut in futures.items():
            try:
                fut.result()
            except BaseException:
                log.exception("tierkv: a load failed; its blocks are recomputed")
                failed.add(key)
        if failed:
            kept = []
            for load in self._loads:
                if id(load.future) not in failed:
                    kept.append(load)
                    continue
                self._fail_load(load.job, 0)
                if load.lent is not None:   # lent before the failure: its rows go back too
                    self._loader.submit(self._end_lend, load.lent)
                self._pool.give(load.buf)
            self._loads = kept
        return self._loads

    def _landed(self, load: _Load, layer: int) -> None:
        """Wait until ``layer`` of ``load``'s pages is in its buffer, or its get ended."""
        fut = load.future
        spins, t0 = 0, time.perf_counter()
        while load.served is None and landed.read(load.record, landed.LAYERS) <= layer:
            if fut is None or fut.done():
                if fut is None or fut.exception() is not None:
                    self._resolve()
                break
            spins += 1
            time.sleep(0 if spins < 50 else POLL_S)   # the first waits are short: the daemon is a layer ahead
        if spins:
            with self._lock:
                self.counters.wait_seconds += time.perf_counter() - t0

    def _copy_layer(self, load: _Load, layer: int) -> None:
        job = load.job
        if load.served is not None:   # the get has ended: its count is the truth
            if load.served > load.upto:   # pages it served past those announced (from a peer): catch up
                for earlier in range(layer):
                    self._scatter(load, earlier, max(load.upto, job.skip), load.served)
            load.upto = load.served
        elif layer == 0:
            load.upto = min(landed.read(load.record, landed.PAGES), job.end)
        self._scatter(load, layer, job.skip, load.upto)

    def _scatter(self, load: _Load, layer: int, first: int, end: int) -> None:
        if end <= first:
            return
        skip = load.job.skip
        if load.lent is None:
            self.kv.scatter(layer, load.pages[first:end], load.job.block_ids[first - skip:end - skip])
            return
        assert load.pool is not None
        for i, slot, n in runs(load.lent.slots[first:end]):   # rows of the daemon's pool, in runs
            at = first + i
            self.kv.scatter(layer, load.pool[slot:slot + n], load.job.block_ids[at - skip:at - skip + n])

    def _lend(self, load: _Load) -> bool:
        """Borrow all of ``load``'s pages from the daemon's DRAM (False: not all there, or
        the lend failed; a get serves them)."""
        job = load.job
        try:
            lent = self.store.lend(job.tokens, job.tenant, want=job.end, requested=max(job.requested, job.end),
                                   whole=True)
        except TierKVError as exc:
            log.warning("tierkv: lending %d pages for %s failed (%s); getting them", job.end, job.req_id, exc)
            return False
        if lent.pages < job.end:
            return False
        try:
            current = self.store.dram_pool()
        except TierKVError:
            current = None
        if current is not self._dram_rows:   # the daemon restarted: its pool is another buffer
            self._dram = self._map_dram() if current is not None else None
            if self._dram is None:
                self._end_lend(lent)   # on the loader's thread, which lent it
                return False
        load.lent, load.pool = lent, self._dram
        self._saved(job.req_id, lent.pages)
        load.tiers = ["dram"] * lent.pages
        load.served = lent.pages
        return True

    def _end_lend(self, lent: Lent) -> None:
        """On the loader's thread (a lend ends on the connection that took it)."""
        try:
            self.store.end_lend(lent)
        except TierKVError as exc:   # its connection ended, which ended the lend too
            log.info("tierkv: ending a lend: %s", exc)

    def _copy_layers(self, upto: int) -> None:
        t0 = time.perf_counter()
        try:
            while self._copied < min(upto, self._layers):
                for load in self._loads:
                    self._landed(load, self._copied)
                    if load in self._loads:   # not failed meanwhile
                        self._copy_layer(load, self._copied)
                self._copied += 1
        except BaseException:
            log.exception("tierkv: copying loaded pages failed; their blocks are recomputed")
            for load in self._resolve():
                self._fail_load(load.job, 0)
            self._copied = self._layers
        with self._lock:
            self.counters.scatter_seconds += time.perf_counter() - t0
        if self._copied >= self._layers:
            self._release_loads()

    def _release_loads(self) -> None:
        loads, self._loads = self._resolve(), []
        for load in loads:
            served = load.served or 0
            self._count(load, served)
            if served < load.job.end:
                self._fail_load(load.job, served)
            if load.lent is not None:
                self._loader.submit(self._end_lend, load.lent)
            self._pool.give(load.buf)

    def _finish_layers(self) -> None:
        """Copy whatever this step's loads have not copied yet. vLLM waits for every layer
        before its attention; should a layer be skipped, its copy still lands before the
        blocks are used by a later step, and the step's blocks are reported for recompute
        (the skipped attention read them before the copy)."""
        if not self._loads:
            return
        late = self._copied < self._layers
        jobs = [load.job for load in self._loads]
        self._copy_layers(self._layers)
        if late:
            log.warning("tierkv: vLLM ran attention layers without waiting for their loads; recomputing those blocks")
            for job in jobs:
                self._fail_load(job, 0)

    def _get(self, load: _Load) -> int:
        """Pages of ``load``'s job the store served into its buffer (0 on a store error)."""
        job = load.job
        try:
            exact = job.accept == "exact"   # derived and lossy pages come whole, from an ordinary get
            res = self.store.get(job.tokens, load.buf[:job.end], job.tenant, requested=max(job.requested, job.end),
                                 landed=load.record if exact else None,
                                 **store_accept(job.accept))  # type: ignore[arg-type]
        except TierKVError as exc:
            log.warning("tierkv: loading %d pages for %s failed (%s); vLLM recomputes them",
                        len(job.block_ids), job.req_id, exc)
            return 0
        n = min(res.pages, job.end)
        if res.evicted is not None and res.evicted[job.skip:n].any():   # paged attention cannot drop a token
            n = job.skip + int(np.flatnonzero(res.evicted[job.skip:n].any(axis=1))[0])   # (vLLM's own hit is not read)
        self._saved(job.req_id, n)
        load.tiers = [kind.value for kind in res.tiers[:n]]
        return n

    def _count(self, load: _Load, served: int) -> None:
        """Count what ``load`` gave vLLM (its pages past vLLM's own hit)."""
        job, bs = load.job, self.kv.block_tokens
        loaded = max(0, served - job.skip) * bs
        with self._lock:
            self.counters.loaded_tokens += loaded
            if load.lent is not None:
                self.counters.lent_tokens += loaded
            for kind in load.tiers[job.skip:served]:
                self.counters.tokens_by_tier[kind] = self.counters.tokens_by_tier.get(kind, 0) + bs

    def _fail_load(self, job: LoadJob, served: int) -> None:
        lost = job.block_ids[max(served - job.skip, 0):]
        self._saved(job.req_id, served)
        with self._lock:
            self._errors.update(lost)
            self._step_errors.update(lost)
            self.counters.failed_load_tokens += len(lost) * self.kv.block_tokens

    def load_errors(self) -> set[int]:
        """Blocks whose loads failed since the last call."""
        with self._lock:
            out, self._errors = self._errors, set()
        return out

    # -- saves ------------------------------------------------------------------------
    def _saved(self, req_id: str, pages: int) -> None:
        """The request's leading ``pages`` are (after a load, a put) or may not all be
        (after a failure: pass where the gap may start) in the store."""
        with self._lock:
            self._confirmed[req_id] = pages

    def save_layer(self, layer: int) -> None:
        """The forward pass wrote layer ``layer``: copy it out of the saved blocks."""
        for job, start, _buf, pages, seen in self._saving:
            if layer not in seen:
                try:
                    self.kv.gather(layer, job.block_ids[start:], pages[start:job.end])
                except Exception:   # noqa: BLE001 - the save is dropped in end_step, vLLM goes on
                    log.exception("tierkv: copying layer %d of %s's blocks failed", layer, job.req_id)
                    continue
                seen.add(layer)

    def end_step(self) -> None:
        """Finish this step's copies (loads included, so that their failures are in
        :meth:`load_errors`) and put the saved pages in the background. A save whose
        pages were computed over a block whose load failed in this step is dropped."""
        self._finish_layers()
        saving, self._saving = self._saving, []
        with self._lock:
            failed = set(self._step_errors)
        for job, start, buf, pages, seen in saving:
            ok = not failed.intersection(job.block_ids)
            for layer in range(self._layers):
                if ok and layer not in seen:
                    try:
                        self.kv.gather(layer, job.block_ids[start:], pages[start:job.end])
                    except Exception:   # noqa: BLE001
                        log.exception("tierkv: copying layer %d of %s's blocks failed", layer, job.req_id)
                        ok = False
            if not ok:
                self._saved(job.req_id, 0)
                self._pool.give(buf)
                with self._lock:
                    self.counters.skipped_saves += 1
                continue
            with self._lock:
                self._puts += 1
                self._inflight[job.req_id] = self._inflight.get(job.req_id, 0) + 1
            self._saver.submit(self._put, job, start, buf)

    def _put(self, job: SaveJob, start: int, buf: np.ndarray) -> None:
        confirmed = 0   # unless the put shows every page up to the job's end is in the store
        try:
            res = self.store.put(job.tokens, buf[:job.end], job.tenant, announce=False, unfilled=start)
            with self._lock:
                self.counters.saved_pages += res.stored
            if res.stored + res.already_present >= job.end - start:
                confirmed = job.end
            else:   # an earlier page has gone (evicted): the next save starts from page 0
                log.info("tierkv: %s's pages %d-%d were not stored (an earlier page is not in the store)",
                         job.req_id, start, job.end - 1)
        except TierKVError as exc:
            log.warning("tierkv: saving pages %d-%d of %s failed (%s)", start, job.end - 1, job.req_id, exc)
            with self._lock:
                self.counters.failed_saves += 1
        except BaseException:
            log.exception("tierkv: saving pages of %s failed", job.req_id)
            with self._lock:
                self.counters.failed_saves += 1
        finally:
            self._pool.give(buf)   # before the count drops, so a waiting take() finds it
            with self._lock:
                self._puts -= 1
                left = self._inflight.get(job.req_id, 1) - 1
                if left > 0:
                    self._inflight[job.req_id] = left
                else:
                    self._inflight.pop(job.req_id, None)
                if job.req_id in self._gone:   # finished meanwhile: forget it once its puts are done
                    if left <= 0:
                        self._gone.discard(job.req_id)
                else:
                    self._confirmed[job.req_id] = confirmed

    def forget(self, req_ids: set[str]) -> None:
        """Requests vLLM finished: drop what the worker knew of them."""
        with self._lock:
            for r in req_ids:
                self._confirmed.pop(r, None)
                if r in self._inflight:
                    self._gone.add(r)

    def _putting(self) -> bool:
        with self._lock:
            return self._puts > 0

    def drain(self) -> None:
        """Wait for every put handed to the background."""
        self._saver.submit(lambda: None).result()

    def close(self) -> None:
        self._finish_layers()
        with self._early_lock:
            self._bound = 1 << 62   # no more early loads
            early, self._early = list(self._early.values()), {}
        for load in early:
            self._loader.submit(self._drop_early, load)
        self._loader.shutdown(wait=True)
        self._saver.shutdown(wait=True)
