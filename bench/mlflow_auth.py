"""What MLflow's basic auth costs the stack's tracking server, with and without its cache.

    PYTHONPATH=. .venv/bin/python -m bench.mlflow_auth [--quick] [--requests N] [--record]

The server is the stack's (infra.services.start_mlflow with infra.auth.StackSecrets: the
basic-auth app, one worker, a SQLite store), started twice: once with the auth config the
stack writes (a successful password check cached for MLFLOW_AUTH_CACHE_TTL_S) and once with
the cache line removed (the baseline: MLflow's default, a scrypt check on every request).
On each, this process logs in as the stack's clients do (MLFLOW_TRACKING_USERNAME/PASSWORD)
and makes N `log_metric` calls one after another, what a training's tracking sends. Figures:
the server's CPU seconds per request (from /proc, its process and children) and requests/s
as the client sees them; the ratio is cached / uncached (CPU: < 1 is cheaper; rate: > 1 is
faster). The two servers start in an order that alternates between rounds.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from unittest import mock

import psutil
from mlflow.tracking import MlflowClient

from bench.common import Result, command_line, load_average, median, print_results, record_entry
from infra.auth import MLFLOW_AUTH_CACHE_TTL_S, StackSecrets
from infra.services import free_port, start_mlflow, stop


def _server_cpu_s(pid: int) -> float:
    process = psutil.Process(pid)
    processes = [process, *process.children(recursive=True)]
    return sum(sum(p.cpu_times()[:2]) for p in processes)


def _one(cached: bool, requests: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="ddpflow-bench-mlflow-auth-") as folder:
        root = Path(folder)
        secrets = StackSecrets.create(root / "secrets")
        if not cached:
            ini = secrets.mlflow_auth_config.read_text()
            line = f"auth_cache_ttl_seconds = {MLFLOW_AUTH_CACHE_TTL_S}\n"
            assert line in ini, "the stack's auth config no longer sets the cache"
            secrets.mlflow_auth_config.write_text(ini.replace(line, ""))
        port = free_port()
        store = f"sqlite:///{root / 'mlflow.db'}"
        server = start_mlflow(
            port, store, (root / "artifacts").as_uri(), {}, root,
            auth_env=secrets.mlflow_server_env(),
        )  # fmt: skip
        login = secrets.client_env()
        names = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
        try:
            with mock.patch.dict(os.environ, {k: login[k] for k in names}):
                client = MlflowClient(server.url)
                run_id = client.create_run(client.create_experiment("auth-bench")).info.run_id
                client.log_metric(run_id, "warm", 0.0)
                cpu_before = _server_cpu_s(server.pid)
                started = time.perf_counter()
                for step in range(requests):
                    client.log_metric(run_id, "loss", 1.0 / (step + 1), step=step)
                elapsed = time.perf_counter() - started
                cpu = _server_cpu_s(server.pid) - cpu_before
        finally:
            stop(server)
    return {"cpu_per_request_s": cpu / requests, "requests_per_s": requests / elapsed}


def measure(rounds: int, requests: int) -> dict[bool, list[dict[str, float]]]:
    found: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for r in range(rounds):
        for cached in (True, False) if r % 2 == 0 else (False, True):
            found[cached].append(_one(cached, requests))
            print(f"round {r} cached={cached}: {found[cached][-1]}", flush=True)
    return found


def _results(found: dict[bool, list[dict[str, float]]], requests: int) -> list[Result]:
    rows = []
    for key, figure, unit, how in (
        ("cpu_per_request_s", "server CPU per request", "s", "cached/uncached CPU (info)"),
        ("requests_per_s", "log_metric calls/s", "calls/s", "cached/uncached rate (info)"),
    ):
        cached = median([row[key] for row in found[True]])
        uncached = median([row[key] for row in found[False]])
        note = f"median of {len(found[True])} round(s) of {requests} sequential calls"
        rows.append(
            Result(
                "mlflow_auth", figure, cached, uncached, unit, cached / uncached, how, None, note
            )
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = command_line(
        "bench.mlflow_auth", __doc__, quick="1 round of 50 calls", record="mlflow_auth"
    )
    parser.add_argument("--requests", type=int, default=None, help="calls per server (200)")
    args = parser.parse_args(argv)
    rounds = 1 if args.quick else 2
    requests = args.requests or (50 if args.quick else 200)
    load_before = load_average()
    results = _results(measure(rounds, requests), requests)
    print_results("the stack's MLflow: basic auth with and without its cache", results)
    if args.record:
        command = "python -m bench.mlflow_auth" + (" --quick" if args.quick else "")
        record_entry("mlflow_auth", command, load_before, results)


if __name__ == "__main__":
    main()
