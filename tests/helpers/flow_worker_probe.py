"""Run as a script: a flow's LocalCluster (prepared as a flow prepares it) with one worker
whose nanny gives it its own PREFECT_API_URL; prints, as JSON, what the worker had before
any task (was Prefect imported?) and the API URL Prefect's root settings give there.

Its own interpreter: a process starts one forkserver, with its first cluster, and keeps its
preload list, so the test's process (whose clusters may have started one) cannot show it."""

from __future__ import annotations

import json
import os
import sys

import distributed

from ddpflow.cluster.build import local_cluster
from ddpflow.integrations.prefect.flow_workers import prepare_flow_workers

PARENT_URL = "http://127.0.0.1:9/parent/api"
NANNY_URL = "http://127.0.0.1:9/nanny/api"


def ask() -> dict[str, object]:
    imported = "prefect" in sys.modules  # before this function imports anything of Prefect
    from prefect.settings import get_current_settings

    return {"prefect_before_any_task": imported, "api_url": get_current_settings().api.url}


def main() -> None:
    os.environ["PREFECT_API_URL"] = PARENT_URL  # what the forkserver reads at its import
    if "--not-prepared" not in sys.argv:
        prepare_flow_workers()
    with (
        local_cluster(1, env={"PREFECT_API_URL": NANNY_URL}, tls=False) as cluster,
        distributed.Client(cluster) as client,
    ):
        client.wait_for_workers(1, timeout=120)
        (answer,) = client.run(ask).values()
    print(json.dumps(answer))


if __name__ == "__main__":
    main()
