"""A shaped S3 endpoint: a proxy on 127.0.0.1 that makes a local S3 server answer as a
remote one does, for benchmarks and tests.

    .venv/bin/python -m bench.s3_shaper --upstream http://127.0.0.1:PORT [--port P]
                                        [--latency-ms 30] [--rate-mbps 80]

Each connection a client opens gets its own connection to the upstream server, and the
bytes pass through unchanged both ways: the request line, the Host header the client
signed, its Authorization and Range headers reach the server as they were sent, so an S3
v4 signature verifies (the client signs for the proxy's host:port, which is the Host the
server sees). What is shaped is the upstream's answers, per connection as S3 limits a
connection rather than a client:

- latency: the first byte of each response leaves no earlier than `latency` after its
  request (the last bytes the client sent) reached the proxy: S3's first-byte latency;
- rate: each connection's bytes to the client are paced to `rate` bytes/s from a
  response's first byte on (idle time earns no credit), as one S3 connection is capped.

A client that never pipelines (botocore, aiohttp) sends a request, reads its response, then
sends the next: the proxy takes bytes from the client after bytes went back as a new
request. It needs no HTTP parsing for that, and never rewrites a byte.

Tests add faults (`Fault`): a request whose head matches a pattern (e.g. its Range) is
refused with a 503, cut after some bytes of its response, or held for a while.
In a test, `Shaper(upstream).start()` runs it on a thread of the test's process; a
benchmark runs it as its own process (`python -m bench.s3_shaper`), so its CPU is not the
measured client's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

DEFAULT_LATENCY_S = 0.030
DEFAULT_RATE = 80e6  # bytes/s a connection
READ_BYTES = 256 * 1024  # per read from the upstream: coarse enough to pace cheaply
REFUSED = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


@dataclass
class Fault:
    """What to do to a request whose head (its first bytes from the client) matches
    `pattern` (a regex over bytes, case-insensitive), at most `times` times (None: always).

    action "refuse": answer 503 without asking the upstream; "cut": pass `cut_after` bytes
    of the response, then close the connection; "stall": hold the response `stall_s`."""

    pattern: bytes
    action: str
    times: int | None = None
    cut_after: int = 0
    stall_s: float = 0.0
    hits: int = 0

    def __post_init__(self) -> None:
        if self.action not in ("refuse", "cut", "stall"):
            raise ValueError(f"fault action {self.action!r} is not refuse, cut or stall")

    def takes(self, head: bytes) -> bool:
        if self.times is not None and self.hits >= self.times:
            return False
        if re.search(self.pattern, head, re.IGNORECASE) is None:
            return False
        self.hits += 1
        return True


@dataclass
class _Exchange:
    """One client connection's state between its two directions."""

    requested_at: float = 0.0
    awaiting: bool = False  # a request went up; its response has not started
    pace_from: float = 0.0
    paced_bytes: int = 0
    cut_left: int | None = None  # bytes of this response still passed before closing
    stall_s: float = 0.0


@dataclass
class Shaper:
    """The proxy: `start()` on a thread of this process (for tests), or `serve()` in a
    running event loop (the command line)."""

    upstream: str
    latency_s: float = DEFAULT_LATENCY_S
    rate: float = DEFAULT_RATE
    port: int = 0  # 0: one the OS picks (tests); the command line passes a free one
    faults: list[Fault] = field(default_factory=list)
    connections: int = 0  # clients' connections accepted so far
    _loop: asyncio.AbstractEventLoop | None = field(default=None, init=False, repr=False)
    _server: asyncio.Server | None = field(default=None, init=False, repr=False)
    _thread: threading.Thread | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def serve(self) -> asyncio.Server:
        self._server = await asyncio.start_server(
            self._handle, "127.0.0.1", self.port, limit=4 * READ_BYTES
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return self._server

    def start(self) -> str:
        """Serve on a daemon thread of this process; the proxy's URL."""
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            loop.run_until_complete(self.serve())
            ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name="s3-shaper", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the S3 shaper did not start in 10 s")
        return self.url

    def stop(self) -> None:
        if self._loop is None or self._server is None:
            return
        loop, server = self._loop, self._server

        async def close() -> None:
            server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(10)

    async def _handle(
        self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter
    ) -> None:
        self.connections += 1
        where = urlsplit(self.upstream)
        try:
            up_in, up_out = await asyncio.open_connection(
                where.hostname, where.port, limit=4 * READ_BYTES
            )
        except OSError:
            client_out.close()
            return
        exchange = _Exchange()
        tasks = [
            asyncio.create_task(self._requests(client_in, up_out, client_out, exchange)),
            asyncio.create_task(self._responses(up_in, client_out, exchange)),
        ]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            for writer in (client_out, up_out):
                writer.close()

    async def _requests(
        self,
        client_in: asyncio.StreamReader,
        up_out: asyncio.StreamWriter,
        client_out: asyncio.StreamWriter,
        exchange: _Exchange,
    ) -> None:
        """Client to upstream, unchanged; each new request starts its latency clock."""
        while data := await client_in.read(READ_BYTES):
            if not exchange.awaiting:  # the first bytes of a request: its head
                fault = next((f for f in self.faults if f.takes(data)), None)
                if fault is not None and fault.action == "refuse":
                    client_out.write(REFUSED)
                    await client_out.drain()
                    return
                exchange.cut_left = fault.cut_after if fault and fault.action == "cut" else None
                exchange.stall_s = fault.stall_s if fault and fault.action == "stall" else 0.0
            exchange.requested_at = time.monotonic()
            exchange.awaiting = True
            up_out.write(data)
            await up_out.drain()

    async def _responses(
        self, up_in: asyncio.StreamReader, client_out: asyncio.StreamWriter, exchange: _Exchange
    ) -> None:
        """Upstream to client: a response's first byte after the latency, then paced."""
        while data := await up_in.read(READ_BYTES):
            now = time.monotonic()
            if exchange.awaiting:
                exchange.awaiting = False
                first = exchange.requested_at + self.latency_s + exchange.stall_s
                if first > now:
                    await asyncio.sleep(first - now)
                exchange.pace_from, exchange.paced_bytes = time.monotonic(), 0
            if exchange.cut_left is not None:
                data = data[: exchange.cut_left]
                exchange.cut_left -= len(data)
            client_out.write(data)
            await client_out.drain()
            if exchange.cut_left == 0:
                return  # the connection closes mid-response
            exchange.paced_bytes += len(data)
            due = exchange.pace_from + exchange.paced_bytes / self.rate
            if (wait := due - time.monotonic()) > 0:
                await asyncio.sleep(wait)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.s3_shaper",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--upstream", required=True, help="the S3 server, http://host:port")
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0: any free)")
    parser.add_argument(
        "--latency-ms", type=float, default=DEFAULT_LATENCY_S * 1000, help="first-byte latency (30)"
    )
    parser.add_argument(
        "--rate-mbps",
        type=float,
        default=DEFAULT_RATE / 1e6,
        help="MB/s (10^6 bytes) a connection (80)",
    )
    args = parser.parse_args(argv)
    shaper = Shaper(args.upstream, args.latency_ms / 1000, args.rate_mbps * 1e6, args.port)

    async def run() -> None:
        server = await shaper.serve()
        stopped = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stopped.set)
        # The port on stdout, so whoever started this process finds it.
        print(f"shaping {args.upstream} at {shaper.url}", flush=True)
        await stopped.wait()
        server.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(server.wait_closed(), 1)

    asyncio.run(run())


if __name__ == "__main__":
    main()
