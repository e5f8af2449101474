"""Checks of API arguments shared by the in-process store and the connected client, so
both raise the same errors with the same messages."""

from __future__ import annotations

from tierkv.errors import InputError

GET_LIST_MESSAGE = ("get(out=...): takes one batch buffer ([n, *page_shape] in the layout's dtype, or "
                    "uint8 [n, page_bytes]), whose rows become the pages; a list of separate pages is "
                    "for put only")


def check_requested(requested: object, want: int) -> None:
    """``get(requested=...)``: None, or an integer >= the rows of ``out``."""
    if requested is None:
        return
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < want:
        raise InputError(f"get: requested must be an integer >= the {want} rows of out, got {requested!r}")


def check_unfilled(unfilled: object, rows: int) -> None:
    """``put(unfilled=...)``: an integer from 0 to the rows given."""
    if isinstance(unfilled, bool) or not isinstance(unfilled, int) or not 0 <= unfilled <= rows:
        raise InputError(f"put: unfilled must be an integer from 0 to the {rows} rows, got {unfilled!r}")
