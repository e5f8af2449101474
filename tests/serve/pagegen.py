"""Prompts and page bytes that any process can check: the bytes are a pure function of
the page's tokens. Imported by the tests and by the client processes they start."""

from __future__ import annotations

import numpy as np

from tests.conftest import LAYOUT, PB

TPP = LAYOUT.tokens_per_page


def prompt(i: int, pages: int) -> np.ndarray:
    return np.random.default_rng(i + 5000).integers(0, 50000, pages * TPP, dtype=np.int64)


def pages_of(tokens: np.ndarray) -> np.ndarray:
    """The bytes of each full page of ``tokens``, seeded by its prefix."""
    n = len(tokens) // TPP
    out = np.empty((n, PB), np.uint8)
    for j in range(n):
        seed = int(tokens[:(j + 1) * TPP].astype(np.uint64).sum()) * 1000003 + j
        out[j] = np.random.default_rng(seed).integers(0, 256, PB, dtype=np.uint8)
    return out
