"""The splice tests' model: one small Llama for the whole session (tests/splice/llama.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def llama() -> object:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.splice.llama import make_llama
    return make_llama()
