"""The exception hierarchy of tierkv.

Every error the library raises on purpose derives from :class:`TierKVError`, so a
serving engine can catch one type. Messages name what was expected and what was
given, with the numbers involved.
"""

from __future__ import annotations


class TierKVError(Exception):
    """Root of every error tierkv raises on purpose."""


class ConfigError(TierKVError):
    """A configuration file or dataclass is invalid or inconsistent with a store."""


class LayoutError(TierKVError):
    """A KV layout declaration is invalid."""


class InputError(TierKVError):
    """An argument to the API has the wrong dtype, shape, device, layout or value."""


class StoreClosedError(TierKVError):
    """The store (or a tier) was used after ``close()``."""


class StoreBusyError(TierKVError):
    """Another process holds the store's writer lock."""


class CapacityError(TierKVError):
    """A request cannot fit: more pages than a tier holds, or nothing evictable."""


class TierIOError(TierKVError):
    """A tier's read or write failed at the operating-system level."""


class CorruptPageError(TierKVError):
    """A page read back does not match its recorded length or checksum."""


class TierUnavailableError(TierIOError):
    """A tier is degraded (its fabric link or device is gone): its pages are misses until it recovers."""


class StoreUnavailableError(TierKVError):
    """A connected store's daemon cannot be reached (not running, restarting, or too slow
    to answer); the client reconnects by itself on its next call."""


class AccessDeniedError(TierKVError):
    """A connected client asked for a tenant its user may not use (``[serve] tenants``)."""


class ClusterUnavailableError(TierKVError):
    """The cluster's etcd did not answer within its deadline (the node goes on serving its
    own tiers; what it publishes waits until etcd answers again)."""


class ClusterRefusedError(TierKVError):
    """etcd answered and refused the request (a lease not found, a request too large, a
    compare that failed): not an absence of etcd."""
