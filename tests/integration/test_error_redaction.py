"""A rank's error quoting a credential reaches no MLflow tag, Prefect artifact, log line or
exception unredacted: the real error MLflow raises for a tracking server that is down, whose
message quotes the tracking URI with its user:password@, raised on real Dask workers (the
`dask_client` LocalCluster) and recorded in a real MLflow SQLite store."""

from __future__ import annotations

import logging
import traceback
from pathlib import Path

import distributed
import pytest
from mlflow.tracking import MlflowClient

from ddpflow.distributed.supervisor.relaunch import Restart, RestartsExhausted, launch_with_restarts
from ddpflow.tracking.run import log_restart, start_run
from ddpflow.workloads.charlm.data import FormattedCorpus
from ddpflow.workloads.sweep.config import validate_trial
from ddpflow.workloads.sweep.execute import (
    ERROR_TAG,
    MAX_TAG_LEN,
    SweepSetup,
    fail_run,
    run_trial,
)
from infra.procs import free_port
from tasks.restarts import restarts_markdown
from tests.helpers.as_stranger import run_as_stranger
from tests.helpers.rank_functions import mlflow_fails_once

pytestmark = pytest.mark.integration

PASSWORD = "Tr4ck-S3cret"


def down_server_uri() -> str:
    return f"http://alice:{PASSWORD}@127.0.0.1:{free_port()}"


def assert_clean(text: str) -> None:
    assert PASSWORD not in text, text


@pytest.fixture()
def tracking(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def test_a_restart_cause_is_redacted_in_its_tag_artifact_and_log(
    dask_client: distributed.Client, tracking: str, tmp_path: Path, caplog
) -> None:
    run = start_run(tracking, "redaction", run_name="restart", params={}, tags={})
    (tmp_path / "markers").mkdir()
    with caplog.at_level(logging.WARNING, logger="ddpflow"):
        _, restarts = launch_with_restarts(
            dask_client,
            mlflow_fails_once,
            down_server_uri(),
            str(tmp_path / "markers"),
            world_size=1,
            timeout_s=60,
            max_restarts=1,
            on_restart=lambda restart: log_restart(run, restart.attempt, restart.cause),
        )
    assert len(restarts) == 1
    cause = restarts[0].cause
    assert "MlflowException: API request to http://alice:***@127.0.0.1:" in cause, cause
    tag = MlflowClient(tracking).get_run(run.run_id).data.tags["ddpflow.restart.1.cause"]
    assert "http://alice:***@127.0.0.1:" in tag
    artifact = restarts_markdown(run, restarts)  # the restarts artifact's markdown
    assert "http://alice:***@127.0.0.1:" in artifact
    for text in (cause, *restarts[0].failed_ranks, tag, artifact, caplog.text):
        assert_clean(text)


def test_the_error_a_failed_training_raises_is_redacted(
    dask_client: distributed.Client, tmp_path: Path, caplog
) -> None:
    """What a flow's failed state and its traceback show: the error and its chain."""
    (tmp_path / "markers").mkdir()
    with (
        caplog.at_level(logging.WARNING, logger="ddpflow"),
        pytest.raises(RestartsExhausted) as info,
    ):
        launch_with_restarts(
            dask_client,
            mlflow_fails_once,
            down_server_uri(),
            str(tmp_path / "markers"),
            world_size=1,
            timeout_s=60,
            max_restarts=0,
        )
    printed = "".join(traceback.format_exception(info.value))
    assert "http://alice:***@127.0.0.1:" in printed
    assert_clean(printed)
    assert_clean(caplog.text)
    # Dask's own copy, which its dashboard's /info pages serve: redacted in the rank.
    kept = dask_client.run_on_scheduler(_erred_task_texts)
    assert any("http://alice:***@127.0.0.1:" in text for text in kept), kept
    for text in kept:
        assert_clean(text)


def _erred_task_texts(dask_scheduler: distributed.Scheduler) -> list[str]:
    return [f"{t.exception_text}\n{t.traceback_text}" for t in dask_scheduler.erred_tasks]


@pytest.mark.timeout(60)
def test_another_local_user_gets_no_info_pages_from_the_dashboard(
    dask_client: distributed.Client,
) -> None:
    """Run as `nobody`: the dashboard answers, its /info pages (failed tasks' errors, logs,
    call stacks) do not."""
    base = dask_client.dashboard_link.removesuffix("/status")
    paths = ["/health", "/info/main/exceptions.html", "/info/main/workers.html", "/info/logs"]
    answers = dict(zip(paths, run_as_stranger(FETCH_STATUS, base, *paths).split(), strict=True))
    assert answers["/health"] == "200", answers
    assert {answers[p] for p in paths[1:]} == {"404"}, answers


FETCH_STATUS = """
import sys, urllib.error, urllib.request
for path in sys.argv[2:]:
    try:
        print(urllib.request.urlopen(sys.argv[1] + path, timeout=10).status)
    except urllib.error.HTTPError as error:
        print(error.code)
"""


def test_a_crashed_trial_records_its_error_redacted(
    tracking: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sweep's `ddpflow.error` tag, and the outcome its table artifact and output show."""
    parent = start_run(tracking, "redaction", run_name="sweep", params={}, tags={})
    spec = validate_trial(
        0,
        {
            "epochs": 1,
            "batch_size": 8,
            "lr": 0.01,
            "hidden_size": 8,
            "num_layers": 1,
            "dropout": 0.0,
            "seed": 0,
        },
    )
    assert spec.valid, spec.errors
    corpus = FormattedCorpus(
        train_uri=str(tmp_path / "train.pt"),
        val_uri=str(tmp_path / "val.pt"),
        train_names_uri=str(tmp_path / "names.json"),
        data_hash="0",
        num_train_names=0,
        num_val_names=0,
        num_train_samples=0,
        num_val_samples=0,
        clean_report={},
    )
    setup = SweepSetup(
        corpus=corpus,
        parent=parent,
        experiment="redaction",
        artifact_root=str(tmp_path / "artifacts"),
        artifact_location=None,
        keep_last=1,
    )

    def train(job: object, workers: list[str]) -> object:
        # MLflow's real error, raised here as the launch would re-raise a rank's.
        MlflowClient(down_server_uri()).get_experiment("0")
        raise AssertionError("the tracking server was expected to be down")

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # fail at once
    outcome = run_trial(spec, ["tcp://127.0.0.1:1"], setup, train)
    assert not outcome.completed and outcome.error
    assert "MlflowException: API request to http://alice:***@127.0.0.1:" in outcome.error
    tag = MlflowClient(tracking).get_run(outcome.run_id).data.tags[ERROR_TAG]
    assert "http://alice:***@127.0.0.1:" in tag
    assert_clean(outcome.error)
    assert_clean(tag)


def test_each_record_redacts_what_it_is_given(tracking: str) -> None:
    """The tags and the artifact redact on their own too, whoever calls them with what: an
    error text cut to the tag's length is redacted before the cut (a cut "user:pass" has no
    '@' left to mark it)."""
    raw = f"API request to {down_server_uri()}/api/2.0/mlflow/runs/create failed"
    run = start_run(tracking, "redaction", run_name="records", params={}, tags={})
    log_restart(run, 1, raw)
    fail_run(run, "crash", "x" * (MAX_TAG_LEN - 40) + raw)
    tags = MlflowClient(tracking).get_run(run.run_id).data.tags
    restart = Restart(
        attempt=1, cause=raw, failed_ranks=[], restarted_workers=[], world_size=1, heal_s=0.0
    )
    for text in (
        tags["ddpflow.restart.1.cause"],
        tags[ERROR_TAG],
        restarts_markdown(run, [restart]),
    ):
        assert_clean(text)
