"""DDP across hosts vs the same ranks on one host, in one run.

    .venv/bin/python -m bench.multihost [--quick]     (root: it builds network namespaces)

Two clusters from infra.netns_cluster, each with its Dask scheduler on a `head` host and
its Prefect server, MLflow server and S3 endpoint on the bridge:
(i)  two hosts, one Dask worker each: 2 ranks whose gloo traffic crosses the bridge;
(ii) one host with two Dask workers: the same 2 ranks, all traffic on that host.
On each, `python -m flows.train_charlm --epochs 1` runs twice (the first warms the cluster,
the project and its data), and the second run is measured as bench.launch measures a flow:
time from launch to the first completed step, and the steady samples/s (median of the
20-step windows after the first). Each ratio is two hosts / one host.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from bench.common import Result, command_line, print_results
from bench.launch_runs import QUICK_NAMES, run_flow, source_file
from bench.launch_timing import Timeline
from infra.netns_cluster import NetnsCluster, netns_cluster

LAYOUTS = {"two hosts": {"a": 1, "b": 1}, "one host": {"a": 2}}
STEADY_TARGET = 0.95
RESULTS = Path(__file__).resolve().parent / "results" / "multihost.json"


def _measure(root: Path, name: str, layout: dict[str, int], source: str) -> Timeline:
    work = root / name.replace(" ", "-")
    with netns_cluster(work, layout) as cluster:
        env = _flow_env(cluster, work)
        run_flow(work / "project", source, env, tag="warm-up")
        timeline, _ = run_flow(work / "project", source, env, tag="measured")
        return timeline


def _flow_env(cluster: NetnsCluster, work: Path) -> dict[str, str]:
    return cluster.flow_env(str(work / "project" / "artifacts"))


def run(quick: bool = False) -> list[Result]:
    with tempfile.TemporaryDirectory(prefix="ddpflow-bench-multihost-") as tmp:
        root = Path(tmp)
        source = source_file(root, quick)
        runs = {name: _measure(root, name, layout, source) for name, layout in LAYOUTS.items()}
    two, one = runs["two hosts"], runs["one host"]
    first_ratio = two.first_step_s / one.first_step_s
    steady_ratio = two.steady_samples_per_s / one.steady_samples_per_s
    extra = {name: t.__dict__ for name, t in runs.items()}
    return [
        Result(
            "multihost", "launch -> first step done (warm cluster)", two.first_step_s,
            one.first_step_s, "s", first_ratio, "two hosts/one host time (info)", None,
            "second run on each cluster; Prefect server and workers already up", extra,
        ),
        Result(
            "multihost", "steady samples/s", two.steady_samples_per_s,
            one.steady_samples_per_s, "samples/s", steady_ratio,
            f"two hosts/one host rate >= {STEADY_TARGET:g}", steady_ratio >= STEADY_TARGET,
            "2 ranks x batch 512, gloo over the namespaces' bridge vs within one namespace",
        ),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = command_line("bench.multihost", __doc__, quick=f"first {QUICK_NAMES} names only")
    results = run(parser.parse_args(argv).quick)
    print_results("DDP across hosts", results)
    RESULTS.write_text(json.dumps([r.as_dict() for r in results], indent=1) + "\n")


if __name__ == "__main__":
    main()
