"""tierkv as SGLang's HiCache L3 storage: ``TierKVHiCacheStorage``, loaded as a ``dynamic`` backend.

SGLang (0.5.23) creates it from ``--hicache-storage-backend dynamic`` and a JSON
``--hicache-storage-backend-extra-config`` (docs/integration.md, "SGLang HiCache storage
backend")::

    {"backend_name": "tierkv", "module_path": "tierkv.integrations.sglang",
     "class_name": "TierKVHiCacheStorage", "interface_v1": 1,
     "tierkv_socket": "/var/tmp/tierkv-store/tierkv.sock"}

``tierkv_socket`` reaches a ``tierkv serve`` daemon (any tensor-parallel size);
``tierkv_config`` instead opens the store of that TOML config in this process (one
writer per store: a single-rank engine). ``tierkv_tenant`` (default ``sglang:<model>``)
is the tierkv tenant, what ``[serve] tenants`` grants; ``tierkv_state_dir`` (default the
store's or the socket's directory) keeps the file that ``clear()`` rewrites.
``interface_v1: 1`` makes SGLang call :meth:`batch_get_v1` / :meth:`batch_set_v1`, which
read and write its host pool in place.

SGLang names each page by a hex digest already chained over the page's prefix, and
passes no token ids. Each page is stored as a one-page prompt of stand-in token ids
(:func:`tierkv.integrations.adapter.external_key_tokens`) hashed from the digest, the
model, the rank's shard (TP rank, unless the KV is rank-replicated MLA; PP and
attention-CP ranks), the host pool's page format and the current generation
(``clear()``). A page's bytes are SGLang's flat host page (``get_data_page`` order),
not tierkv's ``page_shape`` order; the format in the key keeps a pool of another
layout from reading them. Called from SGLang's prefetch, hit-query and backup threads
at once: every method is thread-safe.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import numpy as np
import torch

from tierkv.errors import CapacityError, ConfigError, InputError, LayoutError, StoreUnavailableError, TierIOError
from tierkv.integrations import MissingDependencyError
from tierkv.integrations.adapter import external_key_tokens
from tierkv.layout import DType, KVLayout, LayoutKind
from tierkv.serve.client import RemoteStore
from tierkv.store.api import Store

#: How to install what this module needs (the ``hicache_storage`` module imports these).
INSTALL_HINT = ("pip install --no-deps sglang==0.5.23 && pip install pybase64==1.5.1 triton==3.9.0 "
                "starlette==1.10.0 msgspec==0.23.0 pyzmq==27.3.0 aiohttp==3.14.5")

if TYPE_CHECKING:
    _Base = object
else:
    try:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _Base
    except ImportError:  # the module still imports (docs, type checks); the backend says what to install
        _Base = object

log = logging.getLogger(__name__)

AnyStore = Union[Store, RemoteStore]

#: Failures of one page's transfer: a miss or a failed write, never an exception to SGLang.
_TRANSIENT = (TierIOError, StoreUnavailableError, CapacityError)


@dataclass(frozen=True)
class BackendSettings:
    """The backend's keys of SGLang's extra config (the others are SGLang's own)."""

    config_path: str | None = None
    socket_path: str | None = None
    tenant: str | None = None
    state_dir: str | None = None

    @classmethod
    def parse(cls, extra: Mapping[str, object] | None) -> BackendSettings:
        """From the extra config; ConfigError names what is missing, doubled or unknown."""
        extra = extra or {}
        names = {"tierkv_config": "config_path", "tierkv_socket": "socket_path", "tierkv_tenant": "tenant",
                 "tierkv_state_dir": "state_dir"}
        unknown = sorted(k for k in extra if k.startswith("tierkv_") and k not in names)
        if unknown:
            raise ConfigError(f"unknown tierkv keys in the HiCache extra config: {', '.join(unknown)}; "
                              f"expected {', '.join(names)}")
        values: dict[str, str] = {}
        for key, field in names.items():
            value = extra.get(key)
            if value is not None:
                if not isinstance(value, str) or not value:
                    raise ConfigError(f"HiCache extra config {key} must be a non-empty string, got {value!r}")
                values[field] = value
        if ("config_path" in values) == ("socket_path" in values):
            raise ConfigError("the HiCache extra config needs exactly one of tierkv_socket (a tierkv serve daemon) "
                              "and tierkv_config (a store config opened in this process)")
        return cls(**values)


def host_pool_layout(pool: Any) -> KVLayout:
    """The KV layout of one page of SGLang's host pool (MHA: K and V per head; MLA: one latent
    vector per token). LayoutError when the pool holds something tierkv cannot declare."""
    name = type(pool).__name__
    try:
        dtype = DType.parse(str(pool.dtype).removeprefix("torch."))
    except LayoutError as exc:
        raise LayoutError(f"SGLang host pool {name} holds {pool.dtype}: {exc}") from None
    if hasattr(pool, "kv_cache_dim"):
        return KVLayout(pool.layer_num, 1, pool.kv_cache_dim, dtype, pool.page_size, LayoutKind.LATENT)
    if hasattr(pool, "head_num") and hasattr(pool, "head_dim"):
        if getattr(pool, "v_head_dim", pool.head_dim) != pool.head_dim:
            raise LayoutError(f"SGLang host pool {name} has K head_dim {pool.head_dim} and V head_dim "
                              f"{pool.v_head_dim}; a tierkv page holds K and V of one head_dim")
        return KVLayout(pool.layer_num, pool.head_num, pool.head_dim, dtype, pool.page_size, LayoutKind.KV)
    raise LayoutError(f"SGLang host pool {name} is neither an MHA nor an MLA KV pool; tierkv has no layout for it")


def check_layout(store: KVLayout, pool: Any) -> None:
    """Refuse a host pool whose pages are not the store's: LayoutError names both layouts."""
    want = host_pool_layout(pool)
    sample = pool.get_data_page(0, flat=False)
    page_bytes = sample.numel() * sample.element_size()
    if want != store or page_bytes != store.page_bytes:
        raise LayoutError(f"the tierkv store's pages are {store} ({store.page_bytes} bytes); SGLang's host pool "
                          f"({type(pool).__name__}, layout {pool.layout}) expects {want} ({page_bytes} bytes per "
                          "page): give the store that [layout] (page size = --page-size)")


class _Generation:
    """Which generation of pages is current, kept in a file so that every rank and every
    restart agree: ``clear()`` writes a fresh random id and the pages of older ones become
    unreachable (they stay until evicted: the Store API removes nothing)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._value = ""

    def current(self) -> str:
        """The current id ("" before the first clear); re-read when the file changed."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return ""
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        with self._lock:
            if stamp != self._stamp:
                self._value, self._stamp = self.path.read_text(encoding="ascii").strip(), stamp
            return self._value

    def advance(self) -> str:
        """Start a new generation: written, synced, then renamed into place."""
        value = os.urandom(8).hex()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{threading.get_ident()}")
        with open(tmp, "w", encoding="ascii") as f:
            f.write(value + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return value


class TierKVHiCacheStorage(_Base):  # type: ignore[misc]
    """SGLang's ``HiCacheStorage`` over a tierkv store; see the module docstring.

    ``store``: the open store or daemon client (``store.stats()`` for its counters).
    """

    def __init__(self, storage_config: Any, kwargs: Mapping[str, object] | None = None) -> None:
        if _Base is object:
            raise MissingDependencyError(f"the SGLang backend needs sglang 0.5.23: {INSTALL_HINT}")
        if storage_config.should_split_heads:
            raise ConfigError("tierkv does not split heads between TP sizes (tp_lcm_size); leave it unset")
        settings = BackendSettings.parse(storage_config.extra_config)
        self.config = storage_config
        self.model = storage_config.model_name or ""
        self.tenant = settings.tenant if settings.tenant is not None else f"sglang:{self.model}"
        self.writer = bool(storage_config.is_storage_writer)
        if settings.socket_path is not None:
            self.store: AnyStore = Store.connect(settings.socket_path)
            state = Path(settings.state_dir or Path(settings.socket_path).parent)
        else:
            assert settings.config_path is not None
            local = Store.open(settings.config_path)
            self.store = local
            state = Path(settings.state_dir or local.config.path)
        digest = hashlib.sha256(f"{self.tenant}\0{self.model}".encode()).hexdigest()[:16]
        self._generation = _Generation(state / f"sglang-generation-{digest}")
        shard = [f"pp{storage_config.pp_rank}/{storage_config.pp_size}",
                 f"cp{storage_config.attn_cp_rank}/{storage_config.attn_cp_size}"]
        if not storage_config.is_mla_model:   # MLA KV is the same on every TP rank
            shard.insert(0, f"tp{storage_config.tp_rank}/{storage_config.tp_size}")
        self._shard = "|".join(shard)
        self._identity: str | None = None   # set by register_mem_pool_host
        self._tpp = self.store.layout.tokens_per_page
        self._page_bytes = self.store.layout.page_bytes
        self._zero_copy = False
        self._local = threading.local()
        self._closed = False
        if not (storage_config.extra_config or {}).get("interface_v1"):
            log.warning("tierkv HiCache backend: set \"interface_v1\": 1 in the extra config, or SGLang copies "
                        "every page through a temporary tensor (batch_get/batch_set)")

    # -- setup ----------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take SGLang's host KV pool: refused (LayoutError) unless its pages are the store's."""
        check_layout(self.store.layout, mem_pool_host)
        sample = mem_pool_host.get_data_page(0, flat=False)
        buffer = getattr(mem_pool_host, "kv_buffer", None)
        # In place only where a page is one contiguous view of the pool (MLA's page_first
        # layouts); MHA pools keep K and V apart, so those pages go through one copy.
        self._zero_copy = (isinstance(buffer, torch.Tensor) and sample.is_contiguous()
                           and sample.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr())
        self._identity = f"{self.model}|{self._shard}|{mem_pool_host.layout}"
        self.mem_pool_host = mem_pool_host

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Hybrid models' pools: refused (LayoutError) but for the KV pool, which
        ``register_mem_pool_host`` took: tierkv has no layout for Mamba, SWA or indexer state."""
        if str(host_pool_name) != "kv":
            raise LayoutError(f"tierkv stores full-attention KV pages only; SGLang's {host_pool_name!s} pool has "
                              "no tierkv layout (use a full-attention model, or another backend)")

    # -- keys -----------------------------------------------------------------------------
    def _key_tokens(self, keys: Sequence[str]) -> list[np.ndarray]:
        if self._identity is None:
            raise InputError("tierkv HiCache backend: register_mem_pool_host must come before page calls")
        head = f"{self._identity}|{self._generation.current()}|"
        return [external_key_tokens(head + key, self._tpp) for key in keys]

    def _host_pages(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[int]:
        ps = self._tpp
        if host_indices.numel() != len(keys) * ps:
            raise InputError(f"{len(keys)} keys need {len(keys) * ps} host indices ({ps} per page), "
                             f"got {host_indices.numel()}")
        return [int(i) for i in host_indices[::ps].tolist()]

    def _staging(self) -> torch.Tensor:
        """This thread's one-page buffer (``uint8 [1, page_bytes]``): in memory the daemon
        shares when connected, so that the daemon reads and fills it in place."""
        buf: torch.Tensor | None = getattr(self._local, "page", None)
        if buf is None:
            rows = (self.store.page_buffer(1) if isinstance(self.store, RemoteStore)
                    else np.empty((1, self._page_bytes), dtype=np.uint8))
            buf = self._local.page = torch.from_numpy(rows)
        return buf

    def _host_rows(self, index: int) -> torch.Tensor:
        """The host page at ``index`` as ``uint8 [1, page_bytes]``, a view of the pool."""
        return self.mem_pool_host.get_data_page(index, flat=False).view(torch.uint8).reshape(1, self._page_bytes)

    # -- pages ----------------------------------------------------------------------------
    def _load(self, tokens: np.ndarray, index: int) -> bool:
        """One page from the store into the host pool; False on a miss or a failed read."""
        pool = self.mem_pool_host
        rows = self._host_rows(index) if self._zero_copy else self._staging()
        try:
            got = self.store.get(tokens, rows, self.tenant).pages == 1
        except _TRANSIENT as exc:
            log.warning("tierkv HiCache backend: a page load failed, counted as a miss: %s", exc)
            return False
        if got and not self._zero_copy:
            pool.set_from_flat_data_page(index, rows.view(pool.dtype).reshape(-1))
        return got

    def _save(self, tokens: np.ndarray, page: torch.Tensor) -> bool:
        """One page (``uint8 [1, page_bytes]``) into the store; True if it is there after."""
        try:
            res = self.store.put(tokens, page, self.tenant)
        except _TRANSIENT as exc:
            log.warning("tierkv HiCache backend: a page store failed: %s", exc)
            return False
        return res.stored + res.already_present == 1

    def _host_page_bytes(self, index: int) -> torch.Tensor:
        """The host page at ``index`` as ``uint8 [1, page_bytes]``: a view, or this thread's copy."""
        if self._zero_copy:
            return self._host_rows(index)
        page = self.mem_pool_host.get_data_page(index, flat=False)
        out = self._staging()
        out.view(page.dtype).view(page.shape).copy_(page)
        return out

    def _value_bytes(self, value: torch.Tensor, what: str) -> torch.Tensor:
        nbytes = value.numel() * value.element_size()
        if nbytes != self._page_bytes:
            raise InputError(f"{what}: a page is {self._page_bytes} bytes, got {nbytes} ({value.dtype} "
                             f"{list(value.shape)})")
        if value.device.type != "cpu":
            value = value.cpu()
        return value.contiguous().view(torch.uint8).reshape(1, self._page_bytes)

    # -- HiCacheStorage ---------------------------------------------------------------------
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading keys the store holds (SGLang's keys chain their prefix, so the
        first miss ends what can be loaded). One engine query is one ``stats().lookups``."""
        for i, tokens in enumerate(self._key_tokens(keys)):
            try:
                hit = self.store.lookup(tokens, self.tenant, count=(i == 0)).cached_pages == 1
            except _TRANSIENT as exc:
                log.warning("tierkv HiCache backend: a lookup failed, counted as a miss: %s", exc)
                hit = False
            if not hit:
                return i
        return len(keys)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Load each key's page into the host pool page at ``host_indices[i * page_size]``.
        After the first miss nothing more is read (SGLang uses the leading run only)."""
        out = [False] * len(keys)
        for i, (tokens, index) in enumerate(zip(self._key_tokens(keys), self._host_pages(keys, host_indices))):
            if not self._load(tokens, index):
                break
            out[i] = True
        return out

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Store each key's host page (a key already stored is left as it is). After the
        first failure nothing more is written: a page past a gap is never loadable. A rank
        that does not write rank-replicated (MLA) KV reports success and writes nothing."""
        pages = self._host_pages(keys, host_indices)
        if not self.writer:
            return [True] * len(keys)
        out = [False] * len(keys)
        for i, (tokens, index) in enumerate(zip(self._key_tokens(keys), pages)):
            if not self._save(tokens, self._host_page_bytes(index)):
                break
            out[i] = True
        return out

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """The page of ``key`` in ``target_location`` (a flat host page; a new uint8 page when
        None), or None on a miss."""
        target = target_location if target_location is not None else torch.empty(self._page_bytes, dtype=torch.uint8)
        rows = self._value_bytes(target, "get(target_location)")
        if target_location is not None and rows.data_ptr() != target.data_ptr():
            raise InputError("get(target_location): the target must be a contiguous CPU tensor")
        try:
            got = self.store.get(self._key_tokens([key])[0], rows, self.tenant).pages == 1
        except _TRANSIENT as exc:
            log.warning("tierkv HiCache backend: a page load failed, counted as a miss: %s", exc)
            return None
        return target if got else None

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        targets = target_locations if target_locations is not None else [None] * len(keys)
        return [self.get(key, target) for key, target in zip(keys, targets)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store ``value`` (one flat page) as the page of ``key``; a stored key is left as it is."""
        if value is None:
            raise InputError("set: value (the page) is required")
        page = self._value_bytes(value, "set(value)")
        return True if not self.writer else self._save(self._key_tokens([key])[0], page)

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        if values is None or len(values) != len(keys):
            raise InputError(f"batch_set: {len(keys)} keys need as many values")
        return all(self.set(key, value) for key, value in zip(keys, values))

    def clear(self) -> None:
        """Make every page this backend stored a miss, on every rank and after restarts: a new
        generation (see :class:`_Generation`). Raises OSError when its file cannot be written."""
        value = self._generation.advance()
        log.info("tierkv HiCache backend: cleared (generation %s in %s)", value, self._generation.path)

    def close(self) -> None:
        """Close the store this backend opened (or its connection to the daemon). Idempotent."""
        if not self._closed:
            self._closed = True
            self.store.close()
