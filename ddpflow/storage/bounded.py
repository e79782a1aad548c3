"""A blocking call that the caller waits for only so long."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def call_bounded(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """`fn()`'s result or exception, waiting at most `timeout_s`; TimeoutError naming `what`.

    For client libraries that retry a dead server for minutes. `fn` runs on a daemon thread,
    which cannot be stopped: after a timeout it goes on until `fn` returns, and nobody waits
    for it, not even at interpreter exit.
    """
    done: concurrent.futures.Future[T] = concurrent.futures.Future()

    def call() -> None:
        try:
            done.set_result(fn())
        except BaseException as error:  # noqa: BLE001 - handed to the waiting caller
            done.set_exception(error)

    threading.Thread(target=call, name=f"bounded-{what}", daemon=True).start()
    try:
        return done.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise TimeoutError(f"{what} did not finish within {timeout_s:g}s") from None
