"""What the test suite costs on this machine, where its CPU goes, and that cost in units of a
reference workload measured in the same run.

    .venv/bin/python -m bench.suite_cost [--record] [-- PYTEST ARGS]
    .venv/bin/python -m bench.suite_cost --per-module tests/integration/test_s3.py ...

The same code has taken 16 to 47 minutes on these 2-core machines (docs/testing.md): a wall
time alone says as much about the hour as about the code. So the reference runs before and
after the suite (a fresh interpreter that imports torch, MLflow, Dask and Prefect's server,
then trains a small LSTM for REFERENCE_STEPS steps on one thread: the suite's mix of imports
and training, in small), and the suite's CPU seconds are also given as a multiple of the
reference's. That multiple moves with the code much more than with the machine.

Without --per-module, pytest runs as `make test` runs it (TEST_PROCS processes, default 2,
`-m "not gpu"`, the group scheduler of tests/conftest.py) unless PYTEST ARGS are given, with
the bench.suite_timeline plugin, while /proc is sampled every SAMPLE_EVERY_S: the machine's
busy share, and the CPU seconds of each kind of process (forked Dask workers, forkservers,
Prefect servers, the pytest processes...). A process that starts and ends between two
samples is not seen: its CPU is in "unattributed", the machine's total less the kinds. It
prints the wall time, the CPU by kind, each pytest process's modules in order (first start,
last end, summed test time) and the figures as result rows.

With --per-module each given path runs alone in one pytest process, one after another, and
the CPU seconds of that pytest process's tree are printed (from the kernel's accounting of
waited-for children, so other work on the machine does not count), with the machine's.
"""

from __future__ import annotations

import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from bench.common import Result, command_line, load_average, print_results, record_entry
from bench.suite_timeline import TIMELINE_ENV

REPO = Path(__file__).resolve().parents[1]
SAMPLE_EVERY_S = 2.0
COSTLIEST_PROCESSES = 25
REFERENCE_STEPS = 200
REFERENCE_RUNS = 3  # before the suite, and as many after
# 12 minutes: the time `make test` is to take on 2 cores (docs/testing.md).
TARGET_WALL_S = 720.0
REFERENCE = f"""
import torch, mlflow, distributed, prefect.server.api.server
torch.set_num_threads(1)
torch.manual_seed(0)
lstm = torch.nn.LSTM(32, 32, num_layers=2, batch_first=True)
head = torch.nn.Linear(32, 31)
optimizer = torch.optim.Adam([*lstm.parameters(), *head.parameters()], lr=0.01)
x, y = torch.randn(512, 8, 32), torch.randint(0, 31, (512, 8))
for _ in range({REFERENCE_STEPS}):
    optimizer.zero_grad()
    out, _ = lstm(x)
    torch.nn.functional.cross_entropy(head(out).transpose(1, 2), y).backward()
    optimizer.step()
"""


def make_test_args() -> list[str]:
    """pytest's arguments in `make test` (Makefile), with its TEST_PROCS default."""
    processes = os.environ.get("TEST_PROCS", "2")
    return ["-m", "not gpu", "-n", processes, "--dist", "loadscope", "--no-loadscope-reorder"]


def reference_cpu_s() -> float:
    """CPU seconds of one reference run (its own process, so its imports are cold)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", REFERENCE], cwd=REPO, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


# (what a command line contains, its kind), first match wins; forked Dask workers are told
# from their forkserver by their parent (kind_of).
KINDS = [
    ("multiprocessing.forkserver", "forkserver"),
    # Before "pytest": its data folder is under pytest-of-<user>.
    ("bin/weed ", "S3 endpoint (SeaweedFS)"),
    ("prefect.server", "Prefect server"),
    ("prefect server start", "Prefect server"),
    ("-m prefect", "Prefect command line"),
    ("bin/prefect", "Prefect command line"),
    ("-m flows.", "python -m flows/examples"),
    ("-m examples.", "python -m flows/examples"),
    ("exec(eval(sys.stdin", "pytest processes"),
    ("pytest", "pytest processes"),
    ("bin/dask ", "dask scheduler/worker command"),
    ("s3_endpoint", "S3 endpoint (moto)"),
    ("moto", "S3 endpoint (moto)"),
    ("mlflow", "MLflow server"),
    ("bin/pip", "pip (image build)"),
    ("-m pip", "pip (image build)"),
    ("docker", "Docker engine"),
    ("containerd", "Docker engine"),
    ("runc", "Docker engine"),
    ("chrom", "Chromium"),
    ("slurm", "Slurm"),
    ("munge", "Slurm"),
    ("python", "other Python"),
]


def kind_of(command: str, parent_command: str) -> str:
    """The kind of a process, from its command line and its parent's."""
    if "multiprocessing.forkserver" in command and "multiprocessing.forkserver" in parent_command:
        return "Dask workers (forked)"
    for part, kind in KINDS:
        if part in command:
            return kind
    return "other" if command else "kernel threads, exited"


@dataclass
class Seen:
    kind: str
    cpu_at_first_sight: float  # subtracted for a process that was there before the run
    cpu: float
    command: str
    parent_command: str
    first_seen: float  # time.monotonic()
    last_seen: float

    @property
    def cpu_s(self) -> float:
        return self.cpu - self.cpu_at_first_sight


def _proc_stat(pid: str) -> tuple[str, float, str] | None:
    """(parent pid, CPU seconds, start time in ticks) of a process, None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return fields[1], (int(fields[11]) + int(fields[12])) / ticks, fields[19]


def _command(pid: str) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return ""


def machine_cpu_s() -> tuple[float, float]:
    """(busy, all) CPU seconds of the machine since boot, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    ticks = os.sysconf("SC_CLK_TCK")
    idle = values[3] + values[4]  # idle, iowait
    return (sum(values) - idle) / ticks, sum(values) / ticks


class Sampler(threading.Thread):
    """CPU seconds of every process, sampled every `every_s` until stop()."""

    def __init__(self, every_s: float = SAMPLE_EVERY_S):
        super().__init__(daemon=True)
        self.every_s = every_s
        self.seen: dict[tuple[str, str], Seen] = {}
        self._done = threading.Event()
        self._first = True
        self.sample()

    def sample(self) -> None:
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or (stat := _proc_stat(pid)) is None:
                continue
            parent, cpu, started = stat
            known = self.seen.get((pid, started))
            now = time.monotonic()
            if known is None:
                command, parent_command = _command(pid), _command(parent)
                kind = kind_of(command, parent_command)
                first_cpu = cpu if self._first else 0.0
                known = Seen(kind, first_cpu, cpu, command, parent_command, now, now)
                self.seen[(pid, started)] = known
            known.cpu, known.last_seen = cpu, now
        self._first = False

    def run(self) -> None:
        while not self._done.wait(self.every_s):
            self.sample()

    def stop(self) -> Counter[str]:
        """CPU seconds by kind since the sampler started."""
        self._done.set()
        self.join()
        self.sample()
        by_kind: Counter[str] = Counter()
        for seen in self.seen.values():
            by_kind[seen.kind] += seen.cpu_s
        return by_kind

    def costliest(self, count: int = COSTLIEST_PROCESSES) -> list[Seen]:
        """The `count` processes that used the most CPU while sampled."""
        return sorted(self.seen.values(), key=lambda seen: -seen.cpu_s)[:count]


def print_costliest_processes(processes: list[Seen], width: int = 110) -> None:
    """One line each: CPU seconds, seconds seen alive, kind, command line and the parent's
    (which names the test or server that started it)."""
    print(f"\nThe {len(processes)} costliest processes (CPU-s, seen alive s, kind, command):")
    for seen in processes:
        alive_s = seen.last_seen - seen.first_seen
        print(f"  {seen.cpu_s:6.1f} {alive_s:6.0f}  {seen.kind}: {seen.command[:width]}")
        print(f"  {'':14} parent: {seen.parent_command[:width]}")


@dataclass(frozen=True)
class RunOfATest:
    process: str
    nodeid: str
    start: float
    end: float
    cpu_s: float


def read_timeline(lines: Iterable[str]) -> list[RunOfATest]:
    """bench.suite_timeline's lines, one per test."""
    found = []
    for line in lines:
        process, start, end, cpu_s, nodeid = line.rstrip("\n").split("\t", 4)
        found.append(RunOfATest(process, nodeid, float(start), float(end), float(cpu_s)))
    return found


@dataclass(frozen=True)
class ModuleSpan:
    process: str
    module: str
    start: float
    end: float
    summed_s: float
    tests: int
    cpu_s: float


def module_spans(tests: Iterable[RunOfATest]) -> list[ModuleSpan]:
    """Each pytest process's modules in the order they started: first start, last end,
    summed test time and CPU; the unit tier is one entry per process ("tests/unit"), its
    tests being handed out one by one."""
    spans: dict[tuple[str, str], list[float]] = {}
    for test in tests:
        path = PurePosixPath(test.nodeid.split("::", 1)[0])
        module = "tests/unit" if path.parent.name == "unit" else str(path)
        span = spans.setdefault((test.process, module), [test.start, test.end, 0.0, 0, 0.0])
        span[0], span[1] = min(span[0], test.start), max(span[1], test.end)
        span[2] += test.end - test.start
        span[3] += 1
        span[4] += test.cpu_s
    found = [ModuleSpan(p, m, s, e, d, int(n), c) for (p, m), (s, e, d, n, c) in spans.items()]
    return sorted(found, key=lambda span: (span.process, span.start))


def print_spans(spans: list[ModuleSpan], at_least_s: float = 5.0) -> None:
    if not spans:
        return
    zero = min(span.start for span in spans)
    print(
        "\nmodules by pytest process (s from the first test; sum = summed test time; cpu ="
        " CPU-s of the pytest process's tree over its tests):"
    )
    for process in sorted({span.process for span in spans}):
        print(f"  {process}")
        for span in (s for s in spans if s.process == process and s.summed_s >= at_least_s):
            print(
                f"    {span.start - zero:6.0f} {span.end - zero:6.0f}  sum {span.summed_s:5.0f}"
                f"  cpu {span.cpu_s:5.0f}  {span.tests:4d} tests  {span.module}"
            )


COSTLIEST = 30  # tests printed and recorded by their CPU


def costliest(tests: list[RunOfATest]) -> list[RunOfATest]:
    """The COSTLIEST tests by CPU (a module's fixtures count for its first test)."""
    return sorted(tests, key=lambda t: -t.cpu_s)[:COSTLIEST]


def print_costliest(tests: list[RunOfATest]) -> None:
    if not tests:
        return
    total = sum(t.cpu_s for t in tests)
    print(f"\nthe {COSTLIEST} costliest tests ({total:.0f} CPU-s in the pytest processes' trees):")
    for test in costliest(tests):
        print(f"  {test.cpu_s:6.1f} CPU-s {test.end - test.start:6.1f} s  {test.nodeid}")


def run_suite(pytest_args: list[str], reference_s: float) -> list[Result]:
    timeline = Path(tempfile.mkdtemp(prefix="ddpflow-suite-timeline-"))
    env = {
        **os.environ,
        TIMELINE_ENV: str(timeline),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    argv = [sys.executable, "-m", "pytest", "-p", "bench.suite_timeline", *pytest_args]
    print("running:", " ".join(argv[1:]), flush=True)
    sampler = Sampler()
    busy0, all0 = machine_cpu_s()
    started = time.monotonic()
    sampler.start()
    try:
        exit_code = subprocess.run(argv, cwd=REPO, env=env, check=False).returncode
    finally:
        wall_s = time.monotonic() - started
        by_kind = sampler.stop()
        busy1, all1 = machine_cpu_s()
    tests = read_timeline(line for f in sorted(timeline.glob("*.tsv")) for line in f.open())
    spans = module_spans(tests)
    shutil.rmtree(timeline, ignore_errors=True)
    suite_cpu_s = busy1 - busy0
    busy_share = suite_cpu_s / (all1 - all0)
    by_kind["unattributed"] = suite_cpu_s - sum(by_kind.values())
    print(f"\npytest exited {exit_code} after {wall_s:.0f} s; machine busy {busy_share:.0%}")
    print(f"CPU seconds by kind of process ({suite_cpu_s:.0f} in all):")
    for kind, seconds in by_kind.most_common():
        print(f"  {seconds:7.0f}  {kind}")
    print_spans(spans)
    print_costliest(tests)
    print_costliest_processes(sampler.costliest())
    extra = {
        "exit_code": exit_code,
        "busy_share": round(busy_share, 3),
        "cpu_s_by_kind": {k: round(v) for k, v in by_kind.most_common()},
        "costliest_tests_cpu_s": {t.nodeid: round(t.cpu_s, 1) for t in costliest(tests)},
    }
    return [
        Result(
            "suite_cost", "CPU of the pytest run", suite_cpu_s, reference_s, "CPU-s",
            suite_cpu_s / reference_s, "suite / reference (lower: cheaper)", None,
            f"{busy_share:.0%} of the machine's CPU over the run", extra,
        ),
        Result(
            "suite_cost", "wall time of the pytest run", wall_s, reference_s, "s",
            wall_s / reference_s, f"wall <= {TARGET_WALL_S:.0f} s", wall_s <= TARGET_WALL_S,
        ),
    ]  # fmt: skip


def children_cpu_s() -> float:
    """CPU seconds of this process's waited-for descendants so far: a pytest run's whole
    process tree once it has exited (its workers, servers and their children are reaped by
    their parents in turn, and orphans by this process: become_subreaper), whatever else the
    machine runs meanwhile."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def become_subreaper() -> None:
    """Make this process the reaper of its descendants' orphans (Linux's
    PR_SET_CHILD_SUBREAPER): a forkserver or server that outlives the pytest process that
    started it is then reaped here, with its CPU and its own reaped children's, instead of by
    init, where the accounting above would lose it. The standard library has no prctl."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(36, 1, 0, 0, 0) != 0:  # 36: PR_SET_CHILD_SUBREAPER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def reap_orphans(timeout_s: float = 60.0) -> None:
    """Wait for the orphans a pytest run left to this process (become_subreaper)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return  # none left
        if pid == 0:
            time.sleep(0.2)


def run_per_module(paths: list[str], reference_s: float) -> list[Result]:
    results = []
    for path in paths:
        busy0, _ = machine_cpu_s()
        tree0 = children_cpu_s()
        started = time.monotonic()
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path]
        exit_code = subprocess.run(argv, cwd=REPO, capture_output=True, check=False).returncode
        reap_orphans()
        wall_s, machine_s = time.monotonic() - started, machine_cpu_s()[0] - busy0
        cpu_s = children_cpu_s() - tree0
        print(
            f"{cpu_s:7.0f} CPU-s (its processes; the machine's {machine_s:.0f}) {wall_s:6.0f} s  "
            f"exit {exit_code}  {path}",
            flush=True,
        )
        results.append(
            Result(
                "suite_cost", f"{path} alone", cpu_s, reference_s, "CPU-s",
                cpu_s / reference_s, "module / reference", None,
                f"{wall_s:.0f} s wall; the machine's CPU meanwhile {machine_s:.0f} s",
            )
        )  # fmt: skip
    return results


def main() -> None:
    parser = command_line(__name__, __doc__, record="suite_cost")
    parser.add_argument("--per-module", nargs="+", metavar="PATH", help="each path alone")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments")
    args = parser.parse_args()
    load_before, started = load_average(), time.time()
    before = [reference_cpu_s() for _ in range(REFERENCE_RUNS)]
    print(f"reference: {', '.join(f'{s:.2f}' for s in before)} CPU-s", flush=True)
    if args.per_module:
        become_subreaper()
        results = run_per_module(args.per_module, statistics.median(before))
    else:
        results = run_suite(args.pytest_args or make_test_args(), statistics.median(before))
    after = [reference_cpu_s() for _ in range(REFERENCE_RUNS)] if not args.per_module else []
    if after:
        print(f"reference after: {', '.join(f'{s:.2f}' for s in after)} CPU-s")
        # The machine's speed may drift over a 20-minute run: the ratios use both.
        reference_s = statistics.median(before + after)
        results = [
            Result(**{**r.as_dict(), "baseline": reference_s, "ratio": r.value / reference_s})
            for r in results
        ]
    print_results("test suite cost", results)
    if args.record:
        command = "python -m bench.suite_cost " + " ".join(sys.argv[1:])
        record_entry("suite_cost", command, load_before, results, started)


if __name__ == "__main__":
    main()
