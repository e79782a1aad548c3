"""An HTTP reachability probe that Dask workers run during pre-flight.

Standard library only: the workers import this module to run the probe, and a fresh worker
would otherwise spend seconds importing torch (through the rest of ddpflow) first.

A tracking URI may carry its server's basic-auth credentials (http://user:password@host:port).
urllib does not read them: it takes `user:password@host` for the host, so it fails on them
(`nonnumeric port: 'password@host'`, an error that quotes the password) or, with an explicit
port, looks up a host named `user:password@host` that does not exist. The probe moves them
into an Authorization header and opens the URL without them.
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import urllib.error
import urllib.request
from urllib.parse import unquote, urlsplit, urlunsplit

# A worker that cannot open a connection within this is as good as cut off.
API_PROBE_TIMEOUT_S = 5.0


def _request(url: str) -> urllib.request.Request:
    """A GET of `url` without its user info, which becomes a basic-auth header."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return urllib.request.Request(url)
    userinfo, _, host = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    token = base64.b64encode(f"{unquote(user)}:{unquote(password)}".encode()).decode()
    bare = urlunsplit((parts.scheme, host, parts.path, parts.query, ""))
    return urllib.request.Request(bare, headers={"Authorization": f"Basic {token}"})


def probe_http(url: str, timeout: float = API_PROBE_TIMEOUT_S) -> str | None:
    """None if url answers HTTP at all, else why not. Runs on each worker.

    Any status counts as an answer: behind auth /health may say 401, and that server is
    still reachable. Only a failed connection or a timeout is a failure. The reason names no
    URL (the caller redacts what it shows anyway: an OS error may quote a host).
    """
    try:
        with urllib.request.urlopen(_request(url), timeout=timeout):
            return None
    except urllib.error.HTTPError:
        return None
    # http.client.InvalidURL (not a ValueError): a password with an unencoded / # or ?.
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as error:
        return str(getattr(error, "reason", None) or error) or type(error).__name__


async def probe_http_off_loop(url: str, timeout: float = API_PROBE_TIMEOUT_S) -> str | None:
    """probe_http in a thread: run from a worker's event loop (Dask's Client.run runs a
    coroutine function there), a slow probe must not stall the worker's heartbeats."""
    return await asyncio.to_thread(probe_http, url, timeout)
