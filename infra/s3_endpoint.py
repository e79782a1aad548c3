"""The local S3 endpoint: moto's server, with the service each request is for looked up once.

    python -m infra.s3_endpoint -H 127.0.0.1 -p 9000

serves what `moto_server -H 127.0.0.1 -p 9000` serves, the same way (werkzeug, one thread
per request, moto's request handler): every moto service, so S3 for the data, IAM for the
stack's own user (infra.s3_user) and `/moto-api/` for the health check. The one change:
moto's server works out, for every request, which of its services the request is for, by
listing the folders of its package and then trying a few hundred URL patterns. That was
almost half of its CPU on small S3 reads and writes (`python -m bench.s3_endpoint`, 2026-11-30:
1,200 requests took 4.09 CPU-seconds of moto's server against 2.35 here, 0.58x). The answer
depends only on the host name moto derives from the request (e.g.
`s3.us-east-1.amazonaws.com`, from its signature), so it is kept per host name.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any

from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication,
    MotoRequestHandler,
    create_backend_app,
)
from werkzeug.serving import run_simple


class RememberingDispatcher(DomainDispatcherApplication):
    """moto's dispatcher, which remembers the service it found for each host name."""

    def __init__(self) -> None:
        super().__init__(create_backend_app)
        self._services: dict[str | None, Any] = {}

    def get_backend_for_host(self, host: str | None) -> Any:
        # Called under the dispatcher's lock (get_application), so one thread fills an entry.
        if host not in self._services:
            self._services[host] = super().get_backend_for_host(host)
        return self._services[host]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m infra.s3_endpoint", description=__doc__)
    parser.add_argument("-H", "--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("-p", "--port", type=int, required=True, help="port to bind")
    args = parser.parse_args(argv)
    # As moto's own server: the port is what moto writes into URLs it returns, and a stop
    # signal ends the process with code 0.
    os.environ.setdefault("MOTO_PORT", str(args.port))
    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, lambda *_: sys.exit(0))
    run_simple(
        args.host,
        args.port,
        RememberingDispatcher(),
        threaded=True,
        request_handler=MotoRequestHandler,
    )


if __name__ == "__main__":
    main()
