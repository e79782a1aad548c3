"""Injecting delays into MLflow client calls, per thread, to replay interleavings.

The registry under test is real (a SQLite store); what cannot be arranged with real
components is *when* a call runs relative to another thread's, so chosen `MlflowClient`
methods first call `before(method, args)` in the calling thread: a test blocks there on an
event, or sleeps, to stand for a promoter that was paused (GC, a suspended VM, a stalled
network) at exactly that point.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from mlflow.tracking import MlflowClient

Before = Callable[[str, tuple[object, ...]], None]


def hook_client(monkeypatch: pytest.MonkeyPatch, methods: tuple[str, ...], before: Before) -> None:
    for method in methods:
        original = getattr(MlflowClient, method)

        def hooked(self, *args, _method=method, _original=original, **kwargs):
            before(_method, args)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(MlflowClient, method, hooked)
