"""What a cached page is worth: the prefill time it saves, less the time to load it from its tier.

Recomputing page ``d`` of a prompt (0-based) costs its tokens' share of the model's
linear layers plus attention over everything before it, so deeper pages are dearer;
loading it costs a fixed latency plus its bytes over the tier's bandwidth. A page whose
load takes longer than its recompute is worth nothing in that tier (a slow tier should
not hold the first pages of a prompt), and among the rest a policy weighs each page's
chance of reuse by the seconds a hit saves. All pages are the same size, so seconds
per page rank exactly as seconds per byte.

Used by :mod:`tierkv.policy.gittins` (eviction weights and admission) and available
to any policy through :class:`CostAwarePolicy` (admission only). Pure computation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tierkv.errors import ConfigError
from tierkv.keys import PageKey
from tierkv.policy.base import Policy


@dataclass(frozen=True)
class CostModel:
    """Prefill and load times of one page, in seconds.

    ``linear_s_per_token``: time per prompt token for everything but attention;
    ``attention_s_per_token_pair``: time per (query token, earlier token) pair;
    ``load_latency_s`` and ``load_bytes_per_s``: the tier this model is for.
    """

    tokens_per_page: int
    page_bytes: int
    linear_s_per_token: float
    attention_s_per_token_pair: float
    load_latency_s: float
    load_bytes_per_s: float

    def __post_init__(self) -> None:
        if self.tokens_per_page < 1 or self.page_bytes < 1 or self.load_bytes_per_s <= 0:
            raise ConfigError(f"CostModel needs tokens_per_page >= 1, page_bytes >= 1 and load_bytes_per_s > 0, "
                              f"got {self.tokens_per_page}, {self.page_bytes}, {self.load_bytes_per_s}")
        if min(self.linear_s_per_token, self.attention_s_per_token_pair, self.load_latency_s) < 0:
            raise ConfigError("CostModel times must be >= 0")

    def recompute_s(self, depth: int) -> float:
        """Seconds to prefill page ``depth`` (0-based) given every earlier page."""
        p = self.tokens_per_page
        context = depth * p + (p + 1) / 2          # mean tokens each query attends to
        return p * (self.linear_s_per_token + self.attention_s_per_token_pair * context)

    def load_s(self) -> float:
        """Seconds to load one page from the tier."""
        return self.load_latency_s + self.page_bytes / self.load_bytes_per_s

    def saved_s(self, depth: int) -> float:
        """What a hit on page ``depth`` saves; <= 0 means recomputing it is no slower."""
        return self.recompute_s(depth) - self.load_s()

    def first_worth_loading(self) -> int:
        """The shallowest depth whose load beats its recompute (pages are dearer deeper)."""
        slope = self.attention_s_per_token_pair * self.tokens_per_page ** 2
        gap = -self.saved_s(0)
        if gap < 0:
            return 0
        if slope <= 0:
            return 1 << 62
        return int(gap // slope) + 1


class CostAwarePolicy:
    """Wraps a policy: pages not worth loading from this tier are not admitted to it.

    A page's depth is its position in the prompt of the current request
    (``on_request``), else one more than its resident parent's; a page of unknown depth
    is admitted. Everything else is the wrapped policy's.
    """

    def __init__(self, inner: Policy, cost: CostModel) -> None:
        self.inner = inner
        self._min_depth = cost.first_worth_loading()
        self._request: dict[PageKey, int] = {}
        self._depth: dict[PageKey, int] = {}      # resident pages only

    def on_request(self, keys: Sequence[PageKey], now: float) -> None:
        self._request = {k: d for d, k in enumerate(keys)}
        self.inner.on_request(keys, now)

    def _depth_of(self, key: PageKey, parent: PageKey | None) -> int | None:
        if key in self._request:
            return self._request[key]
        if parent is None:
            return 0
        d = self._depth.get(parent)
        return None if d is None else d + 1

    def insert(self, key: PageKey, parent: PageKey | None) -> None:
        d = self._depth_of(key, parent)
        if d is not None:
            self._depth[key] = d
        self.inner.insert(key, parent)

    def touch(self, key: PageKey) -> None:
        self.inner.touch(key)

    def remove(self, key: PageKey) -> None:
        self._depth.pop(key, None)
        self.inner.remove(key)

    def victims(self, n: int, evictable: Callable[[PageKey], bool]) -> list[PageKey]:
        return self.inner.victims(n, evictable)

    def admit(self, key: PageKey, parent: PageKey | None) -> bool:
        d = self._depth_of(key, parent)
        return (d is None or d >= self._min_depth) and self.inner.admit(key, parent)
