"""Agent context edits without re-prefilling the rest (Leyline, Ma et al., arXiv 2606.01065).

An edit at token ``e`` of a cached conversation changes every page key from ``e`` on
(keys are prefix-chained), so today the whole suffix is prefilled again. A splice keeps
the unchanged suffix's KV and moves it to its new positions; its keys' rotary embedding
is corrected by a rotation (:mod:`~tierkv.splice.rope`). Moved KV attended to the
deleted span when it was computed, so beyond the first layer it is an approximation:
such pages are *derived*, never served where exact pages were asked for.

Built so far (issue 25): :mod:`~tierkv.splice.rope`, the rotation over the store's page
layout, exact against a fresh prefill where the maths says it must be, and
:mod:`~tierkv.splice.ops`, the store's splice (``Store.splice``: deletions, replacements
and insertions) storing derived pages that only ``accept="derived"`` gets and lookups
return. The integrations' edit directive and ``tierkv bench splice`` are next
(docs/splice.md).
"""
