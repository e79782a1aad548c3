"""What both scaling flows share: the sizes, the parent run, one child run per size, the report.

A scaling run is a sweep whose trials differ only in world size, run one after another so
each size has the cluster to itself: concurrent sizes would share CPUs and links and
measure each other. Each child run is started and trained by the training flow's own
functions, so it records what a lone training records (parameters, datasets, description
with the flow run's link, readable name, per-rank system metrics).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ddpflow import storage
from ddpflow.config import Settings
from ddpflow.storage.redact import error_text
from ddpflow.tracking.inspection import DatasetRef
from ddpflow.tracking.loggers import MlflowLogger, RunRef
from ddpflow.tracking.run import end_run, failed_on_error, log_files
from ddpflow.training.result import EpochStats
from ddpflow.workloads.scaling import ScalingConfigError, SizeResult, Target, parse_world_sizes
from ddpflow.workloads.scaling.plots import scaling_plots
from ddpflow.workloads.scaling.report import (
    csv_text,
    markdown_table,
    steady_samples_per_s,
    table_rows,
)
from ddpflow.workloads.scaling.sizes import plan_world_sizes
from ddpflow.workloads.sweep.execute import fail_run
from flows.inspection import tag_flow_run
from flows.params import ParameterError
from flows.preflight import rank_workers, run_preflight
from flows.summary import mlflow_ui_hint, print_last
from flows.workload_run import start_workload_run
from tasks.restarts import DDPWorkload, train_ddp
from tasks.tables import publish_table

REPORT_DIR = "scaling"  # the parent run's artifact folder
WORLD_SIZE_TAG = "ddpflow.scaling.world_size"
# Training flow parameters a scaling run has no use for: it sets the world size per child,
# and evaluates or registers nothing.
NOT_REGISTERED = "not-registered"

StartChild = Callable[[int], RunRef]  # world size -> its child run
Train = Callable[[int, RunRef], Sequence[EpochStats]]  # world size, run -> per-epoch stats


def plan_sizes(world_sizes: str | None) -> list[int]:
    """The sizes to train at, checked against the cluster before any data is read."""
    try:
        asked = parse_world_sizes(world_sizes)  # syntax first: no cluster needed to say so
        return plan_world_sizes(asked, len(rank_workers()))
    except ScalingConfigError as error:
        raise ParameterError(str(error)) from None


def begin(settings: Settings, workload: str, world_sizes: str | None) -> list[int]:
    """Tag the flow run and plan the sizes; bad sizes and an unusable cluster, store or
    tracking server fail here, before any data is read."""
    tag_flow_run(workload)
    sizes = plan_sizes(world_sizes)
    run_preflight(settings, max(sizes))
    return sizes


def start_parent(
    settings: Settings,
    experiment: str,
    workload: str,
    what: str,
    sizes: Sequence[int],
    datasets: Sequence[DatasetRef],
    params: dict[str, Any],
) -> RunRef:
    """The scaling run's parent MLflow run, named and described like a training's: `what`
    at the `sizes`, with the training's `params` and the sizes as `world_sizes`."""
    listed = ", ".join(map(str, sizes))
    return start_workload_run(
        settings,
        experiment,
        workload,
        f"{what} at world sizes {listed}",
        datasets,
        {**params, "world_sizes": ",".join(map(str, sizes))},
    )


def size_trainer(
    settings: Settings,
    training: DDPWorkload,
    job_for: Callable[[RunRef, str], Any],
    rank_timeout_s: float,
    max_restarts: int,
) -> Train:
    """Train one size's child run: the workload's job (`job_for(run, checkpoint folder)`)
    with its checkpoints under the run's own folder, as a lone training keeps them."""

    def train(size: int, run: RunRef) -> Sequence[EpochStats]:
        checkpoints = storage.join(settings.artifact_root, "runs", run.run_id, "checkpoints")
        # A restart relaunches at the same size (min_workers defaults to the world size).
        trained = train_ddp(
            training,
            job_for(run, checkpoints),
            size,
            rank_timeout_s,
            max_restarts,
            launch=settings.launch,
        )
        return trained.history

    return train


def run_sizes(sizes: Sequence[int], start_child: StartChild, train: Train) -> list[SizeResult]:
    """Train at each size in turn. A size that crashes is recorded FAILED with its error and
    the next size still runs, as a sweep's trials do."""
    results = []
    for size in sizes:
        run = start_child(size)
        print(f"world size {size}: training on {size} rank(s), MLflow run {run.run_id}")
        started = time.monotonic()
        try:
            history = list(train(size, run))
        except Exception as error:  # noqa: BLE001 - one size's crash must not stop the others
            message = error_text(error)  # into a tag, the table artifact and output
            fail_run(run, "crash", message)
            results.append(
                SizeResult(
                    size, run.run_id, False, wall_s=time.monotonic() - started, error=message
                )
            )
            print(f"world size {size} failed: {message}")
            continue
        except BaseException:
            end_run(run, failed=True)  # interrupted: record it, then stop
            raise
        wall_s = time.monotonic() - started
        end_run(run)
        results.append(SizeResult(size, run.run_id, True, history, wall_s))
        rate = steady_samples_per_s(history)
        print(f"world size {size} completed: {rate:,.0f} samples/s, {wall_s:.1f} s")
    return results


@dataclass(frozen=True)
class ScalingSummary:
    workload: str
    parent_run_id: str
    rows: list[dict[str, Any]]
    markdown: str
    table_key: str

    @property
    def num_completed(self) -> int:
        return sum(r["status"] == "completed" for r in self.rows)

    def render(self, ui_hint: str) -> str:
        return "\n".join(
            [
                "",
                f"ddpflow: {self.workload} scaling finished, {self.num_completed} of "
                f"{len(self.rows)} world sizes completed",
                f"  MLflow parent run  {self.parent_run_id}",
                "",
                self.markdown,
                f"  plots              {REPORT_DIR}/*.png (parent run artifacts)",
                f"  table              {REPORT_DIR}/scaling.csv, .json, .md (parent run), "
                f"Prefect artifact {self.table_key}",
                f"  MLflow UI          {ui_hint}",
                "",
            ]
        )


def report(
    parent: RunRef, results: Sequence[SizeResult], target: Target, workload: str, table_key: str
) -> ScalingSummary:
    """The table, plots and per-size metrics on the parent run; the table in Prefect."""
    rows = table_rows(results, target)
    markdown = markdown_table(rows, target)
    files = {
        **scaling_plots(rows, workload),
        "scaling.csv": csv_text(rows).encode(),
        "scaling.json": json.dumps(rows, indent=2).encode(),
        "scaling.md": markdown.encode(),
    }
    log_files(parent, files, REPORT_DIR)
    logger = MlflowLogger(parent)
    for row in rows:  # metric step = world size: MLflow's chart of a metric is the curve
        metrics = {k: row[k] for k in ("samples_per_s", "efficiency") if row[k] is not None}
        if metrics:
            logger.log_metrics(metrics, step=row["world_size"])
    publish_table(
        rows,
        table_key,
        f"{workload} scaling: samples/s, efficiency against linear and time to "
        f"{target.label()} per world size (MLflow {parent.run_id})",
    )
    return ScalingSummary(workload, parent.run_id, rows, markdown, table_key)


def measure(
    settings: Settings,
    parent: RunRef,
    sizes: Sequence[int],
    start_child: StartChild,
    train: Train,
    target: Target,
    workload: str,
    table_key: str,
) -> ScalingSummary:
    """Train at every size, report on the parent and finish it; the parent is FAILED if
    anything but a size's own training raises."""
    with failed_on_error(parent):
        results = run_sizes(sizes, start_child, train)
        summary = report(parent, results, target, workload, table_key)
    hint = mlflow_ui_hint(settings.tracking_uri, parent.run_id, parent.experiment_id)
    return finish(parent, summary, hint)


def finish(parent: RunRef, summary: ScalingSummary, ui_hint: str) -> ScalingSummary:
    """End the parent (FAILED when no size completed), print the table, fail if none did."""
    end_run(parent, failed=summary.num_completed == 0)
    print_last(summary.render(ui_hint))
    if summary.num_completed == 0:
        raise RuntimeError(
            f"no world size completed; see the table above and MLflow {parent.run_id}"
        )
    return summary


def child_tags(size: int) -> dict[str, str]:
    return {WORLD_SIZE_TAG: str(size)}
