"""An edit directive on a vLLM request: the connector splices the cached prompt for it.

An agent that edited its context (dropped a stale tool output, replaced a file's
content) sends the edited prompt with ``kv_transfer_params`` naming the edit::

    {"tierkv_edit": {"start": 300, "removed": [...the token ids dropped...], "inserted": 0}}

meaning: the request's prompt is a cached prompt whose tokens ``removed`` (at ``start``)
were replaced by the prompt's ``inserted`` tokens from ``start`` (0: a deletion). The
connector's scheduler half (:meth:`~tierkv.integrations.vllm.plan.ConnectorPlanner.matched`)
rebuilds the cached prompt, splices it through the daemon (:meth:`Store.splice
<tierkv.store.api.Store.splice>`, this model's rotary embedding), once per request, and
loads the derived pages after the exact ones as for ``"tierkv_accept": "derived"``
(which the directive implies; the same rule on vLLM's prefix cache applies). vLLM loads a
prefix only: a deletion's derived pages start at the page the edit is in, so they load
in the same request; a replacement's or an insertion's start after the pages vLLM
computes from the edit, so that request loads exact pages only and saves what it
computes (docs/splice.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tierkv.errors import InputError

#: The most tokens a directive may say were removed (a splice request carries them to the daemon).
MAX_REMOVED = 1 << 20


@dataclass(frozen=True)
class Edit:
    """``removed`` (the cached prompt's tokens at ``start``) replaced by the request's
    prompt's ``inserted`` tokens from ``start``."""

    start: int
    removed: np.ndarray = field(repr=False)
    inserted: int

    @classmethod
    def parse(cls, value: object, prompt_len: int) -> Edit:
        """The directive ``value`` of a prompt of ``prompt_len`` tokens; InputError naming
        what was expected."""
        if not isinstance(value, dict) or set(value) - {"start", "removed", "inserted"} or "start" not in value:
            raise InputError('tierkv_edit must be {"start": int, "removed": [token ids], "inserted": int}, '
                             f"got {value!r:.200}")
        start, removed, inserted = value["start"], value.get("removed", []), value.get("inserted", 0)
        for name, v in (("start", start), ("inserted", inserted)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise InputError(f"tierkv_edit: {name} must be a token count (an int >= 0), got {v!r:.80}")
        try:
            ok = isinstance(removed, Sequence) and not isinstance(removed, (str, bytes)) and len(removed) <= MAX_REMOVED
            ids = np.asarray(removed) if ok else np.zeros((0, 0))
        except (ValueError, TypeError, OverflowError):   # ragged, or not numbers
            ids = np.zeros((0, 0))
        if ids.ndim != 1 or ids.size > MAX_REMOVED or (ids.size and (
                ids.dtype.kind not in "iu" or int(ids.min()) < 0 or int(ids.max()) >= 1 << 32)):
            raise InputError(f"tierkv_edit: removed must be a list of at most {MAX_REMOVED:,} token ids, "
                             f"got {removed!r:.80}")
        if start + inserted > prompt_len:
            raise InputError(f"tierkv_edit: start + inserted ({start} + {inserted}) passes the prompt's "
                             f"{prompt_len} tokens")
        if not removed and not inserted:
            raise InputError("tierkv_edit: an edit removes or inserts something; this one does neither")
        return cls(start, ids.astype(np.uint32), inserted)

    def cached_prompt(self, tokens: Sequence[int]) -> np.ndarray:
        """The prompt before the edit, from the request's ``tokens``."""
        new = np.asarray(tokens, np.uint32)
        return np.concatenate([new[:self.start], self.removed, new[self.start + self.inserted:]])

    def replacement(self, tokens: Sequence[int]) -> np.ndarray:
        return np.asarray(tokens[self.start:self.start + self.inserted], np.uint32)
