"""Fixtures for unit and integration tests alike."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """torch on one intra-op thread for the module (`pytestmark = usefixtures(...)`): tiny
    tensors gain nothing from the thread pool, and on a busy machine it makes tests many
    times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
