"""Fixtures for the integration tests: SmolLM2-135M loaded once per session, and one torch thread.

The model fixture skips, naming the missing packages, where the ``demo`` extra is not
installed (tools/install.sh installs it). Tests that run the model use one torch
thread: a 135M model's operations are too small to split, and on a shared two-core
machine a second thread mostly waits.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tierkv.integrations import smollm2


def demo_missing_reason() -> str | None:
    """Why the model tests cannot run here, or None."""
    missing = smollm2.missing_requirements()
    if missing:
        return f"needs {', '.join(missing)}: {smollm2.INSTALL_HINT}"
    return None


@pytest.fixture(scope="session")
def smol() -> smollm2.LoadedModel:
    """SmolLM2-135M-Instruct in float32 with its tokenizer, loaded once per session."""
    reason = demo_missing_reason()
    if reason is not None:
        pytest.skip(reason)
    return smollm2.load()


@pytest.fixture
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
