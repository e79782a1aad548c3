"""Bounded retries with exponential backoff for transient IO (network blips, throttling)."""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable
from typing import TypeVar

from ddpflow.storage.redact import redact_text

T = TypeVar("T")
log = logging.getLogger(__name__)

# A missing file or a permission problem will not fix itself: retrying only delays the
# clear error the user needs. Everything else that is an OSError (connection reset,
# timeouts, DNS) is worth another try.
PERMANENT_ERRORS: tuple[type[BaseException], ...] = (
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
)
# A full disk or quota, or a read-only filesystem, will not clear up while we wait either.
PERMANENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (OSError, TimeoutError, ConnectionError)
# HTTP statuses worth retrying: throttling and server-side failures.
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# Client-library errors that are not OSErrors (aiohttp under fsspec's http and s3fs,
# botocore under boto3), matched by name so this module imports none of those libraries.
TRANSIENT_ERROR_NAMES = frozenset(
    {
        "ClientConnectionError",
        "ServerDisconnectedError",
        "ClientPayloadError",
        "ServerTimeoutError",
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
    }
)


def is_transient(error: BaseException) -> bool:
    if isinstance(error, PERMANENT_ERRORS):
        return False
    if isinstance(error, OSError) and error.errno in PERMANENT_ERRNOS:
        return False
    if isinstance(error, TRANSIENT_ERRORS):
        return True
    status = getattr(error, "status", None) or getattr(error, "status_code", None)
    if isinstance(status, int):
        return status in TRANSIENT_STATUS
    return any(cls.__name__ in TRANSIENT_ERROR_NAMES for cls in type(error).__mro__)


def retry_call(
    fn: Callable[[], T],
    *,
    what: str,
    attempts: int = 4,
    base_delay_s: float = 0.5,
    max_delay_s: float = 8.0,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Call fn, retrying transient errors up to `attempts` times with doubling delays."""
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as error:  # noqa: BLE001 - classified just below
            if not is_transient(error) or attempt == attempts:
                raise
            delay = min(max_delay_s, base_delay_s * 2 ** (attempt - 1))
            # Client errors quote the URL they failed on, credentials included.
            log.warning(
                "%s failed (%s); retry %d/%d in %.1fs",
                redact_text(what),
                redact_text(str(error)),
                attempt,
                attempts - 1,
                delay,
            )
            sleep(delay)
    raise AssertionError("unreachable")


class OutageTooLong(TimeoutError):
    """A transient failure outlasted its time bound; the message says what to raise.

    A TimeoutError (an OSError), so code that handles a failed write handles this one too.
    """


def retry_for(
    fn: Callable[[], T],
    *,
    what: str,
    bound_s: float,
    hint: str,
    base_delay_s: float = 1.0,
    max_delay_s: float = 15.0,
    on_wait: Callable[[], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """Call fn, retrying transient errors with doubling delays for up to `bound_s` seconds.

    A time bound, not an attempt count: an outage lasts a time, and one attempt against a
    store that stopped answering can itself take a read timeout. `on_wait` runs before each
    pause (e.g. a heartbeat, so the watchdog does not take the wait for a hang). Past the
    bound, OutageTooLong names `what` (redacted) and ends with `hint` (what to raise to wait
    longer), chained to the last error; a permanent error is raised as it is, at once.
    """
    started = clock()
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except Exception as error:  # noqa: BLE001 - classified just below
            if not is_transient(error):
                raise
            waited = clock() - started
            if waited >= bound_s:
                raise OutageTooLong(
                    f"{redact_text(what)} still failed after {waited:.0f} s and {attempt} "
                    f"attempts ({redact_text(_describe(error))}); {hint}"
                ) from error
            # The last pause ends at the bound, so the last attempt is made right there.
            delay = min(max_delay_s, base_delay_s * 2 ** min(attempt - 1, 30), bound_s - waited)
            log.warning(
                "%s failed (%s); attempt %d, retrying in %.1fs (for %.0f s more at most)",
                redact_text(what),
                redact_text(_describe(error)),
                attempt,
                delay,
                bound_s - waited,
            )
            if on_wait is not None:
                on_wait()
            sleep(delay)
            if on_wait is not None:
                on_wait()


def _describe(error: BaseException) -> str:
    text = str(error)  # a timeout often says nothing but its type
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
