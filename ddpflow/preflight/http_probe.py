"""An HTTP reachability probe that Dask workers run during pre-flight.

Standard library only: the workers import this module to run the probe, and a fresh worker
would otherwise spend seconds importing torch (through the rest of ddpflow) first.
"""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request

# A worker that cannot open a connection within this is as good as cut off.
API_PROBE_TIMEOUT_S = 5.0


def probe_http(url: str, timeout: float = API_PROBE_TIMEOUT_S) -> str | None:
    """None if url answers HTTP at all, else why not. Runs on each worker.

    Any status counts as an answer: behind auth /health may say 401, and that server is
    still reachable. Only a failed connection or a timeout is a failure.
    """
    try:
        with urllib.request.urlopen(url, timeout=timeout):
            return None
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, OSError, ValueError) as error:
        return str(getattr(error, "reason", None) or error) or type(error).__name__


async def probe_http_off_loop(url: str, timeout: float = API_PROBE_TIMEOUT_S) -> str | None:
    """probe_http in a thread: run from a worker's event loop (Dask's Client.run runs a
    coroutine function there), a slow probe must not stall the worker's heartbeats."""
    return await asyncio.to_thread(probe_http, url, timeout)
