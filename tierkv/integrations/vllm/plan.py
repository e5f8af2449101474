"""The connector's scheduler half, without vLLM: what a request loads, what each step saves.

vLLM runs this half in its engine-core process and the other half (the copies,
:mod:`tierkv.integrations.vllm.transfer`) in each worker process; the only channel
between them is the :class:`StepPlan` built once per step and pickled to the workers.
Both halves talk to one ``tierkv serve`` daemon (:class:`~tierkv.serve.client.RemoteStore`).

Per request:

1. :meth:`ConnectorPlanner.matched` (vLLM's ``get_num_new_matched_tokens``): the
   leading full pages the store holds, never the whole prompt (vLLM must compute the
   last token), minus what vLLM's own prefix cache already holds. No side effects but
   one: a request with an edit directive has the cached prompt spliced for it first,
   once (:mod:`tierkv.integrations.vllm.edits`).
2. :meth:`ConnectorPlanner.allocated` (``update_state_after_alloc``): pins the pages to
   load, so no policy evicts them before the worker copies them (they stay pinned until
   the request finishes), and records a :class:`LoadJob` for the next plan. A request
   that loads nothing is counted here (one zero-row get: its pages are misses in the
   store's hit rates, and the eviction policy sees the request once). The job is also
   announced to the worker at once (``announce``), which may start its get before the
   plan arrives (:mod:`tierkv.integrations.vllm.early`).
3. :meth:`ConnectorPlanner.plan` (``build_connector_meta``): the loads recorded since
   the last step, and a :class:`SaveJob` per request whose step completes full pages not
   stored yet (prompt and generated tokens alike, so a later turn of a conversation
   finds them; with ``save_generated=False`` only pages of prompt tokens, see
   docs/integration.md on exact outputs). The worker copies a saved page out of vLLM's blocks during the step,
   so vLLM may free the blocks as soon as the request finishes.
4. :meth:`ConnectorPlanner.finished` (``request_finished``): unpins and forgets.

A store error never reaches vLLM (it would kill the engine): a lookup that fails
offers nothing, and the failure is logged once per outage.
"""

from __future__ import annotations

import itertools
import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from tierkv.errors import InputError, StoreUnavailableError, TierKVError
from tierkv.integrations.vllm.edits import Edit
from tierkv.keys import as_token_array
from tierkv.serve.client import RemoteStore
from tierkv.splice.rope import Rope
from tierkv.store.lossy_pages import check_budget
from tierkv.tiers.base import TierKind

log = logging.getLogger(__name__)

#: How a job's ``accept`` names lossy pages at a budget: ``"lossy:4.0"``.
LOSSY = "lossy:"


def leading_ids(tokens: Sequence[int], n: int) -> np.ndarray:
    """The first ``n`` of a request's token ids (vLLM keeps them in a Python list) as the
    store takes them: read once into int64 by ``np.fromiter``, then checked and narrowed to
    uint32 (as :func:`~tierkv.keys.as_token_array` does); fewer where the list is shorter.
    ``as_token_array(list(tokens[:n]))`` copied the list twice: 7-7.8 ms for a 128K-token
    prompt against 2.8-4.7 here (docs/benchmarks.md), paid by the scheduler's lookups.
    InputError (as ``as_token_array``) for ids that are not integers or lie out of range."""
    try:
        ids = np.fromiter(itertools.islice(tokens, n), dtype=np.int64, count=n)
    except (OverflowError, TypeError, ValueError):   # past int64, not ints, or fewer than n
        return as_token_array(list(tokens[:n]))
    return as_token_array(ids)


def lossy_accept(bits: float) -> str:
    """The ``accept`` of a request that takes lossy pages coded at ``bits`` (its float's repr)."""
    return f"{LOSSY}{float(bits)!r}"


def store_accept(accept: str) -> dict[str, object]:
    """The store call's keywords for an ``accept`` (``"exact"``, ``"derived"`` or a
    :func:`lossy_accept`); InputError for anything else."""
    if accept.startswith(LOSSY):
        try:
            return {"accept_lossy": check_budget(float(accept[len(LOSSY):]), "a load's lossy budget")}
        except (ValueError, InputError):
            pass
    elif accept in ("exact", "derived"):
        return {"accept": accept}
    raise InputError(f"a load accepts 'exact', 'derived' or '{LOSSY}BITS' pages, got {accept!r}")


@dataclass(frozen=True)
class LoadJob:
    """Load pages ``skip .. skip+len(block_ids)-1`` of ``tokens`` into ``block_ids``.

    ``tokens`` covers pages ``0 .. skip+len(block_ids)-1`` (the store's keys chain over
    the prefix, and a get starts at page 0); pages before ``skip`` are in vLLM's own
    prefix cache and are not copied. ``requested``: the request's loadable pages, for
    the store's hit rates. ``lend``: every page was in the daemon's DRAM at the lookup, so
    the worker asks to borrow them in place first (else it goes straight to a get: a lend
    that cannot cover them is a round trip the load waits for). ``serial``: the planner's
    number for the job, by which a plan names a load the worker may have started early
    (:mod:`tierkv.integrations.vllm.early`); ``origin``: the planner's random number (a
    note from another planner is not this one's). ``accept``: ``"derived"`` for a request
    that accepts derived pages after the exact ones (spliced, docs/splice.md), or
    ``"lossy:BITS"`` (:func:`lossy_accept`) for one that accepts lossy pages at that budget
    after them (docs/lossy.md): got whole, never lent or layered.
    """

    req_id: str
    tenant: str
    tokens: np.ndarray = field(repr=False)
    skip: int
    block_ids: tuple[int, ...]
    requested: int
    lend: bool = True
    serial: int = 0
    origin: int = 0
    accept: str = "exact"

    @property
    def end(self) -> int:
        return self.skip + len(self.block_ids)

    def same(self, other: LoadJob) -> bool:
        """Whether ``other`` loads the same pages into the same blocks."""
        return (self.origin, self.serial, self.req_id, self.tenant, self.skip, self.block_ids, self.requested,
                self.accept, self.lend) == (
            other.origin, other.serial, other.req_id, other.tenant, other.skip, other.block_ids, other.requested,
            other.accept, other.lend) and np.array_equal(self.tokens, other.tokens)


@dataclass(frozen=True)
class SaveJob:
    """Store pages ``first .. end-1`` of ``tokens``, held in vLLM's blocks ``block_ids[first:]``.

    ``tokens`` and ``block_ids`` cover pages ``0 .. end-1``. Pages before ``first`` should
    be stored already (loaded, or saved by an earlier step); the worker saves from an
    earlier page when one of them did not make it into the store (their blocks are the
    request's still), and saves nothing computed over a block whose load failed.
    """

    req_id: str
    tenant: str
    tokens: np.ndarray = field(repr=False)
    first: int
    block_ids: tuple[int, ...] = field(repr=False)

    @property
    def end(self) -> int:
        return len(self.block_ids)


@dataclass
class StepPlan:
    """What the workers do in one step. ``serial``: the last job serial the planner had
    given out when it made the plan (a load announced early with a serial up to it and not
    in ``loads`` will not be in any later plan); ``origin``: the planner's random number."""

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    serial: int = 0
    origin: int = 0


@dataclass
class _Request:
    tenant: str
    tokens: Sequence[int]        # vLLM's live list of the request's tokens (grows as it generates)
    prompt_len: int
    block_ids: list[int] = field(default_factory=list)
    stored: int = 0              # leading pages known to be in the store (loaded or saved)
    pinned: np.ndarray | None = None   # the prefix pinned for the load, unpinned when it ends
    derived: bool = False        # it loaded derived pages: what it computes attended to them, never saved
    ids: np.ndarray = field(default_factory=lambda: np.empty(0, dtype="<u4"))   # leading ids saves took (room to grow)
    ids_len: int = 0                # how many of ``ids`` hold ids

    def leading(self, n: int) -> np.ndarray:
        """Its first ``n`` token ids (fewer where it has fewer), converted once: a save
        converts only the tokens after those earlier saves took, into a buffer that doubles
        as it fills (a chunked prefill saves every chunk; converting the whole prefix each
        time made a long prompt's saves cost its length squared). The tokens before a
        request's computed ones never change (vLLM appends), so the earlier ids hold."""
        if n > self.ids_len:
            more = leading_ids(self.tokens[self.ids_len:n], n - self.ids_len)
            end = self.ids_len + more.size
            if end > self.ids.size:
                grown = np.empty(max(end, 2 * self.ids.size), dtype="<u4")
                grown[:self.ids_len] = self.ids[:self.ids_len]
                self.ids = grown
            self.ids[self.ids_len:end] = more
            self.ids_len = end
        return self.ids[:min(n, self.ids_len)]


class ConnectorPlanner:
    """The scheduler half over a connection to the node's store (any thread; vLLM uses one).
    ``announce``: called with each load job as soon as it is made (the early channel's
    send), before the plan that carries it. ``rope``: makes the model's rotary embedding,
    for requests with an edit directive (called once, at the first; None: edits are not
    spliced)."""

    def __init__(self, store: RemoteStore, block_size: int, *, load: bool = True, save: bool = True,
                 save_generated: bool = True, announce: Callable[[LoadJob], object] | None = None,
                 rope: Callable[[], Rope] | None = None) -> None:
        self.store = store
        self.announce = announce
        self._serial = 0
        self.origin = secrets.randbits(62) + 1
        self.block_size = block_size
        self.load, self.save, self.save_generated = load, save, save_generated
        self._requests: dict[str, _Request] = {}
        self._loads: list[LoadJob] = []
        self._local_hits: dict[str, int] = {}   # vLLM's own hit per request, from matched()
        self._in_dram: dict[str, int] = {}      # leading pages the lookup found in DRAM, per request
        self._accept: dict[str, str] = {}       # requests that accept derived or lossy pages (kv_transfer_params)
        self._edited: set[str] = set()          # requests whose edit directive was taken (spliced or refused)
        self._exact: dict[str, int] = {}        # leading exact pages the lookup found, per request
        self._make_rope = rope
        self._rope: Rope | None = None
        self._rope_error: str | None = None
        self._down = False

    # -- store calls that must not fail the engine -------------------------------------
    def _ok(self) -> None:
        if self._down:
            log.warning("tierkv: the store at %s answers again", self.store.socket_path)
            self._down = False

    def _failed(self, what: str, exc: TierKVError) -> None:
        if not self._down:
            log.warning("tierkv: %s failed (%s); requests compute their KV until the store answers", what, exc)
        self._down = True

    # -- the four calls ---------------------------------------------------------------
    def matched(self, req_id: str, tokens: Sequence[int], tenant: str, num_computed: int,
                accept: str = "exact", edit: object = None) -> int:
        """Tokens beyond ``num_computed`` (vLLM's own prefix-cache hit) the store can load;
        ``accept="derived"``: derived pages after the exact ones count (a spliced prompt);
        ``accept="lossy:BITS"``: lossy pages at that budget after them (a lossy tier's).
        ``edit``: the request's ``tierkv_edit`` directive (:class:`Edit`), spliced for
        it first where it accepts derived pages, the first time it is asked about.

        The hit is remembered for :meth:`allocated`: vLLM sets the request's
        ``num_computed_tokens`` only after it has called ``update_state_after_alloc``."""
        if edit is not None and accept == "derived" and self.load and req_id not in self._edited:
            self._edited.add(req_id)
            self._splice(req_id, tokens, tenant, edit)
        self._local_hits[req_id] = num_computed
        if accept != "exact":
            self._accept[req_id] = accept
        else:
            self._accept.pop(req_id, None)
        usable = (len(tokens) - 1) // self.block_size
        if not self.load or usable <= 0 or num_computed >= usable * self.block_size:
            return 0
        try:
            res = self.store.lookup(leading_ids(tokens, usable * self.block_size), tenant, count=False,
                                    **store_accept(accept))  # type: ignore[arg-type]
        except TierKVError as exc:
            self._failed("a lookup", exc)
            return 0
        self._ok()
        found, dram = res.cached_pages, TierKind.DRAM.rank
        self._in_dram[req_id] = next((i for i, r in enumerate(res.tier_ranks) if r != dram), found)
        self._exact[req_id] = found - res.derived - res.lossy
        return max(0, min(found, usable) * self.block_size - num_computed)

    def _splice(self, req_id: str, tokens: Sequence[int], tenant: str, directive: object) -> None:
        """Splice the cached prompt ``directive`` names into the derived pages of ``tokens``
        (never raises: a bad directive or a store error is logged and the request served
        without it)."""
        try:
            edit = Edit.parse(directive, len(tokens))
            res = self.store.splice(edit.cached_prompt(tokens), edit.start, edit.start + edit.removed.size,
                                    edit.replacement(tokens), rope=self._model_rope(), tenant=tenant)
        except StoreUnavailableError as exc:
            self._failed("a splice", exc)
            return
        except Exception as exc:   # noqa: BLE001 - a bad directive, a model or page it cannot move: never into vLLM
            log.warning("tierkv: request %s's edit is not spliced: %s", req_id, exc)
            return
        self._ok()
        log.debug("tierkv: request %s spliced: %d derived pages from page %d (%d stored)", req_id, res.derived,
                  res.first_derived, res.stored)

    def _model_rope(self) -> Rope:
        """The model's rotary embedding, made at the first edit; InputError where it cannot
        be (remembered: not tried again for every request)."""
        if self._rope is None:
            if self._rope_error is None:
                try:
                    if self._make_rope is None:
                        raise InputError("this connector was made without the model's rotary embedding")
                    self._rope = self._make_rope()
                except Exception as exc:   # noqa: BLE001 - whatever it is, it must not reach vLLM
                    self._rope_error = f"the model's rotary embedding cannot be read: {exc}"
            if self._rope is None:
                raise InputError(str(self._rope_error))
        return self._rope

    def allocated(self, req_id: str, tokens: Sequence[int], prompt_len: int, tenant: str, block_ids: Sequence[int],
                  num_external: int) -> None:
        """vLLM gave the request ``block_ids`` (all of its blocks, its prefix-cache hit's
        first) and will take ``num_external`` tokens after that hit from the store.
        ``tokens``: the request's tokens, prompt first, as a live list the engine extends."""
        num_computed = self._local_hits.pop(req_id, 0)
        in_dram = self._in_dram.pop(req_id, None)   # None: no lookup seen (try a lend, as ever)
        accept = self._accept.pop(req_id, "exact")
        exact = self._exact.pop(req_id, 0)
        req = self._requests.get(req_id)
        if req is None:
            req = self._requests[req_id] = _Request(tenant, tokens, prompt_len)
        req.block_ids = list(block_ids)
        # vLLM's own prefix-cache hit, under a derived (or lossy) request's own cache_salt,
        # may hold KV an earlier request of that salt loaded so: such a request saves nothing.
        req.derived = req.derived or (accept != "exact" and num_computed > 0)
        usable = (prompt_len - 1) // self.block_size
        whole = leading_ids(tokens, usable * self.block_size)
        if num_external <= 0:
            if whole.size and req.pinned is None:
                try:   # count the request's misses and show it to the eviction policy
                    self.store.get(whole, np.empty((0, self.store.layout.page_bytes), np.uint8), tenant,
                                   requested=usable)
                    self._ok()
                except TierKVError as exc:
                    self._failed("counting a request", exc)
            return
        skip = num_computed // self.block_size
        end = (num_computed + num_external) // self.block_size
        # Only a load that reaches past the exact pages takes derived (or lossy) ones (a
        # replacement's derived pages start after pages vLLM computes): what the rest
        # computes is exact then.
        if accept != "exact" and end <= exact and not num_computed:
            accept = "exact"
        req.derived = req.derived or accept != "exact"
        prefix = whole[:end * self.block_size]
        try:
            pinned = self.store.pin(prefix, tenant)
            self._ok()
        except TierKVError as exc:
            self._failed("pinning pages to load", exc)
            pinned = 0
        if pinned:
            self._unpin(req)
            req.pinned = prefix[:pinned * self.block_size]
        # Pages evicted since matched() are still loaded (and fail there): vLLM has
        # already counted them, and the worker reports their blocks for recompute.
        self._serial += 1
        job = LoadJob(req_id, tenant, prefix, skip, tuple(req.block_ids[skip:end]), usable,
                      lend=accept == "exact" and (in_dram is None or in_dram >= end), serial=self._serial,
                      origin=self.origin, accept=accept)
        self._loads.append(job)
        req.stored = max(req.stored, end)
        if self.announce is not None:
            try:
                self.announce(job)
            except Exception:   # noqa: BLE001 - the plan carries the job; vLLM must not see this
                log.exception("tierkv: announcing a load to the worker failed")

    def plan(self, new: Sequence[tuple[str, Sequence[int], int]],
             cached: Sequence[tuple[str, Sequence[int] | None, bool, int]],
             scheduled: dict[str, int]) -> StepPlan:
        """This step's plan. ``new``: (req_id, block_ids, num_computed) of newly scheduled
        requests; ``cached``: (req_id, new_block_ids or None, resumed, num_computed) of the
        others; ``scheduled``: tokens each computes this step."""
        out = StepPlan(loads=self._loads, serial=self._serial, origin=self.origin)
        self._loads = []
        for req_id, block_ids, computed in new:
            req = self._requests.get(req_id)
            if req is not None:
                req.block_ids = list(block_ids)
                self._save(out, req_id, req, computed + scheduled.get(req_id, 0))
        for req_id, grown, resumed, computed in cached:
            req = self._requests.get(req_id)
            if req is None:
                continue
            if resumed:
                req.block_ids = list(grown or ())
            elif grown:
                req.block_ids.extend(grown)
            self._save(out, req_id, req, computed + scheduled.get(req_id, 0))
        return out

    def _save(self, out: StepPlan, req_id: str, req: _Request, computed: int) -> None:
        if not self.save_generated:
            computed = min(computed, req.prompt_len)
        full = min(computed, len(req.tokens)) // self.block_size
        full = min(full, len(req.block_ids))
        # A request that accepted derived or lossy pages computes over an approximation: its
        # pages, stored under exact keys, would be served to requests that asked for exact ones.
        if not self.save or req.derived or full <= req.stored:
            return
        tokens = req.leading(full * self.block_size)
        out.saves.append(SaveJob(req_id, req.tenant, tokens, req.stored, tuple(req.block_ids[:full])))
        req.stored = full

    def finished(self, req_id: str) -> None:
        """The request ended (any reason): unpin what its load pinned and forget it."""
        self._local_hits.pop(req_id, None)
        self._in_dram.pop(req_id, None)
        self._accept.pop(req_id, None)
        self._exact.pop(req_id, None)
        self._edited.discard(req_id)
        req = self._requests.pop(req_id, None)
        if req is not None:
            self._unpin(req)

    def _unpin(self, req: _Request) -> None:
        if req.pinned is None:
            return
        prefix, req.pinned = req.pinned, None
        try:
            self.store.unpin(prefix, req.tenant)
        except TierKVError as exc:   # a daemon that restarted holds no pins of ours anyway
            self._failed("unpinning", exc)

    def pending(self) -> int:
        """Requests the planner follows."""
        return len(self._requests)
