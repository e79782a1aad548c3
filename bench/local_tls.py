"""What TLS costs the local cluster a flow starts: the same LocalCluster with and without it.

    PYTHONPATH=. .venv/bin/python -m bench.local_tls [--quick] [--rounds N] [--record]

Each round starts `ddpflow.cluster.build.local_cluster(2)` twice, once with its per-run TLS
(the default, DDPFLOW_LOCAL_CLUSTER_TLS on) and once on plain tcp:// (the baseline), in an
order that alternates between rounds, so load that drifts during the run hits both sides.
On each cluster, from this process as a flow's client does:
- start -> first task: from the call (TLS: the certificate is made inside it) until a first
  task's result is back, with both workers joined;
- round trips/s: tiny tasks submitted one after another, each waited for (the launcher's and
  the task runner's traffic: small messages);
- transfer MB/s: a 16 MB result fetched from a worker (what a checkpoint or a rank result
  crossing Dask's comms costs: encryption is per byte).
A figure is the median over rounds; the ratio is TLS / plain (time: > 1 is slower; rate:
< 1 is slower). Round 0 is kept: it is the cold start a flow pays.
"""

from __future__ import annotations

import time

import distributed

from bench.common import Result, command_line, load_average, median, print_results, record_entry
from ddpflow.cluster.build import local_cluster

WORKERS = 2
PAYLOAD_MB = 16


def _payload(size_mb: int) -> bytes:
    return b"\x5a" * (size_mb * 1024 * 1024)


def _one(tls: bool, round_trips: int, transfers: int) -> dict[str, float]:
    started = time.perf_counter()
    with local_cluster(WORKERS, tls=tls) as cluster, distributed.Client(cluster) as client:
        client.wait_for_workers(WORKERS, timeout=120)
        assert client.submit(sum, [1, 2], pure=False).result() == 3
        first_task_s = time.perf_counter() - started
        assert cluster.scheduler_address.startswith("tls://" if tls else "tcp://")

        started = time.perf_counter()
        for i in range(round_trips):
            client.submit(abs, -i, pure=False).result()
        trips_per_s = round_trips / (time.perf_counter() - started)

        times = []
        for _ in range(transfers):
            future = client.submit(_payload, PAYLOAD_MB, pure=False)
            distributed.wait(future)  # made on the worker before the clock starts
            started = time.perf_counter()
            future.result()
            times.append(time.perf_counter() - started)
            future.release()
        transfer_mb_s = PAYLOAD_MB / min(times)
    return {"first_task_s": first_task_s, "trips_per_s": trips_per_s, "mb_s": transfer_mb_s}


def measure(rounds: int, round_trips: int, transfers: int) -> dict[bool, list[dict[str, float]]]:
    found: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for r in range(rounds):
        for tls in (True, False) if r % 2 == 0 else (False, True):
            found[tls].append(_one(tls, round_trips, transfers))
            print(f"round {r} tls={tls}: {found[tls][-1]}", flush=True)
    return found


def _results(found: dict[bool, list[dict[str, float]]], round_trips: int) -> list[Result]:
    def med(tls: bool, key: str) -> float:
        return median([row[key] for row in found[tls]])

    rounds = len(found[True])
    rows = []
    for key, figure, unit, how in (
        ("first_task_s", "cluster start -> first task", "s", "TLS/plain time (info)"),
        ("trips_per_s", "task round trips/s", "tasks/s", "TLS/plain rate (info)"),
        ("mb_s", f"{PAYLOAD_MB} MB result transfer", "MB/s", "TLS/plain rate (info)"),
    ):
        tls, plain = med(True, key), med(False, key)
        rows.append(
            Result(
                "local_tls",
                figure,
                tls,
                plain,
                unit,
                tls / plain,
                how,
                None,
                f"median of {rounds} round(s); {WORKERS} workers"
                + (f", {round_trips} sequential tiny tasks" if key == "trips_per_s" else ""),
            )
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = command_line(
        "bench.local_tls", __doc__, quick="2 rounds, fewer round trips", record="local_tls"
    )
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 4, quick 2)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 4)
    round_trips, transfers = (100, 3) if args.quick else (300, 5)
    load_before = load_average()
    results = _results(measure(rounds, round_trips, transfers), round_trips)
    print_results("local cluster: TLS vs plain tcp://", results)
    if args.record:
        command = "python -m bench.local_tls" + (" --quick" if args.quick else "")
        record_entry("local_tls", command, load_before, results)


if __name__ == "__main__":
    main()
