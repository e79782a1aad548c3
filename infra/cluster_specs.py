"""Print what a cluster kind would submit, without submitting anything.

    # the job script:
    python -m infra.cluster_specs jobqueue infra/jobqueue/slurm-gpu.json
    # the Kubernetes spec:
    python -m infra.cluster_specs kubernetes \
        infra/kubernetes/cluster-options.json > spec.yaml

The options file holds DDPFLOW_CLUSTER_OPTIONS (the same JSON). For jobqueue, a scheduler
starts in this process only long enough to render the script; `n_workers` is ignored, so
no job is queued.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from ddpflow.cluster.build import build_cluster
from ddpflow.cluster.kubernetes import kubernetes_spec

# Options that start or wait for workers: rendering must not queue jobs.
NOT_FOR_RENDERING = ("n_workers", "wait_for_workers_s")


def job_script(options: dict[str, Any]) -> str:
    """The batch script each dask-jobqueue worker job runs."""
    options = {k: v for k, v in options.items() if k not in NOT_FOR_RENDERING}
    cluster = build_cluster("jobqueue", options)
    try:
        return cluster.job_script()
    finally:
        cluster.close()


def kubernetes_yaml(options: dict[str, Any]) -> str:
    """The DaskCluster resource, as YAML for `kubectl apply -f`."""
    return yaml.safe_dump(kubernetes_spec(options), sort_keys=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.cluster_specs", description=__doc__)
    parser.add_argument("kind", choices=["jobqueue", "kubernetes"])
    parser.add_argument("options", type=Path, help="JSON file of DDPFLOW_CLUSTER_OPTIONS")
    args = parser.parse_args(argv)
    options = json.loads(args.options.read_text())
    text = job_script(options) if args.kind == "jobqueue" else kubernetes_yaml(options)
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
