"""What the local S3 endpoint's server costs per request, against moto's own server.

    PYTHONPATH=. .venv/bin/python -m bench.s3_endpoint [--quick] [--rounds N] [--record]

Each round starts both servers in turn on 127.0.0.1, `python -m infra.s3_endpoint` (moto's
server, remembering the service of each host name) and moto's `moto_server` (the baseline),
alternating which goes first, makes a bucket, then times PUTs of 300 objects of 2 KB and 3
GETs of each (1,200 requests, boto3 from this process, one at a time: small objects like a
test's checkpoints, manifests and images). The figure is the CPU seconds the server process
spent on those requests (psutil, its user + system time before and after); the medians over
rounds are shown, the ratio is infra.s3_endpoint / moto_server (below 1: cheaper).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile

import psutil

from bench.common import Result, command_line, load_average, median, print_results, record_entry
from infra.procs import free_port, wait_http
from infra.runtime import BIN, REPO
from infra.services import create_bucket, fake_s3_client

OBJECTS, GETS, SIZE = 300, 3, 2000
BUCKET = "bench-s3-endpoint"
SERVERS = {
    "infra.s3_endpoint": [str(BIN / "python"), "-m", "infra.s3_endpoint"],
    "moto_server": [str(BIN / "moto_server")],
}


def _requests_cpu_s(command: list[str], objects: int) -> float:
    """CPU seconds the server `command` spends on `objects` PUTs and GETS times as many GETs."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen(
            [*command, "-H", "127.0.0.1", "-p", str(port)], cwd=REPO, stdout=log, stderr=log
        )
        try:
            wait_http(f"{url}/moto-api/", 60)
            create_bucket(url, BUCKET)
            s3 = fake_s3_client(url)
            process = psutil.Process(server.pid)
            before = sum(process.cpu_times()[:2])
            body = b"x" * SIZE
            for i in range(objects):
                s3.put_object(Bucket=BUCKET, Key=f"k{i}", Body=body)
            for _ in range(GETS):
                for i in range(objects):
                    assert s3.get_object(Bucket=BUCKET, Key=f"k{i}")["Body"].read() == body
            return sum(process.cpu_times()[:2]) - before
        finally:
            server.terminate()
            server.wait(timeout=30)


def measure(rounds: int, objects: int) -> dict[str, list[float]]:
    found: dict[str, list[float]] = {name: [] for name in SERVERS}
    for r in range(rounds):
        for name in list(SERVERS) if r % 2 == 0 else list(SERVERS)[::-1]:
            found[name].append(_requests_cpu_s(SERVERS[name], objects))
            print(f"round {r} {name}: {found[name][-1]:.2f} CPU-s", flush=True)
    return found


def main(argv: list[str] | None = None) -> None:
    parser = command_line("bench.s3_endpoint", __doc__, quick="1 round", record="s3_endpoint")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of both servers (3)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 3)
    load_before = load_average()
    found = measure(rounds, OBJECTS)
    ours, baseline = median(found["infra.s3_endpoint"]), median(found["moto_server"])
    note = (
        f"median of {rounds} alternating round(s): {OBJECTS} PUTs of {SIZE} B and "
        f"{GETS * OBJECTS} GETs, one at a time"
    )
    results = [
        Result(
            "s3_endpoint", f"server CPU for {(GETS + 1) * OBJECTS} requests", ours, baseline,
            "s", ours / baseline, "infra.s3_endpoint/moto_server (info)", None, note,
        )
    ]  # fmt: skip
    print_results("the local S3 endpoint's CPU per request", results)
    if args.record:
        command = "python -m bench.s3_endpoint" + (" --quick" if args.quick else "")
        record_entry("s3_endpoint", command, load_before, results)


if __name__ == "__main__":
    sys.exit(main())
