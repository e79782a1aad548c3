"""Run a call that a regression could make hang, and fail the test instead of hanging it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest


def outcome_within(seconds: float, fn: Callable[[], Any]) -> BaseException | Any:
    """`fn()`'s result or the exception it raised; the test fails if it runs past `seconds`.

    `fn` runs on a daemon thread, so a read that blocks forever (a FIFO, /dev/zero) leaves
    the thread behind and fails this test, rather than the whole run waiting on it.
    """
    box: list[Any] = []

    def call() -> None:
        try:
            box.append(fn())
        except BaseException as error:  # noqa: BLE001 - handed back to the test
            box.append(error)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"still running after {seconds:g} s: the read is not bounded")
    return box[0]


def raises_within(seconds: float, error: type[BaseException], fn: Callable[[], Any]) -> str:
    """The message of the `error` that `fn()` raises within `seconds` (the test fails else)."""
    result = outcome_within(seconds, fn)
    if not isinstance(result, error):
        pytest.fail(f"expected {error.__name__} within {seconds:g} s, got {result!r:.300}")
    return str(result)
