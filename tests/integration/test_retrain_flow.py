"""`python -m flows.retrain_charlm` against a registry that already has a champion.

Real processes: the flow on a 2-worker LocalCluster, an MLflow SQLite registry. The champion
is registered by the test with a known, poor holdout loss (a constant prediction, no
training), so a 1-epoch challenger is certain to score better.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from ddpflow.workloads.charlm.champion import CHAMPION_ALIAS
from tests.integration.conftest import run_flow
from tests.unit.champion_helpers import (
    add_version,
    constant_model,
    peaked_bias,
    unigram_bias,
    write_holdout,
)

pytestmark = pytest.mark.integration
MODEL = "retrain-test-model"
EXPERIMENT = "retrain-test"
ARTIFACT_ROOT = "DDPFLOW_ARTIFACT_ROOT"
ONE_WORKER = {"DDPFLOW_DASK_WORKERS": "1"}  # a 1-rank DDP group: what is tested is the rule
ARGS = [
    "--epochs", "1", "--hidden-size", "16", "--num-layers", "1", "--batch-size", "2048",
    "--lr", "0.01", "--num-names", "2", "--max-restarts", "0",
    "--model-name", MODEL, "--experiment", EXPERIMENT,
]  # fmt: skip


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> tuple[Path, MlflowClient, str, str]:
    """(project, client, champion version, a newer version that is not champion).

    The newer version is there so that a flow which moved the alias on a failure would
    have somewhere to move it.
    """
    project = tmp_path_factory.mktemp("retrain")
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")  # the flow's (project_env)
    folder = project / "registered"
    champion, _ = add_version(client, MODEL, constant_model(peaked_bias()), folder)
    client.set_registered_model_alias(MODEL, CHAMPION_ALIAS, champion)
    other, _ = add_version(
        client, MODEL, constant_model(unigram_bias(write_holdout(folder))), folder
    )
    return project, client, champion, other


def challenger_runs(client: MlflowClient) -> list:
    experiment = client.get_experiment_by_name(EXPERIMENT)
    if experiment is None:
        return []
    return client.search_runs(
        [experiment.experiment_id],
        filter_string="tags.`ddpflow.role` = 'challenger'",
        order_by=["attributes.start_time DESC"],
    )


def versions(client: MlflowClient) -> list[str]:
    return sorted(str(v.version) for v in client.search_model_versions(f"name='{MODEL}'"))


def alias(client: MlflowClient) -> str:
    return str(client.get_model_version_by_alias(MODEL, CHAMPION_ALIAS).version)


def test_a_challenger_whose_training_fails_leaves_the_champion_alone(registry) -> None:
    # docs/deployments.md "Retraining": a challenger that fails stops the flow before the decision,
    # so it never touches the alias.
    project, client, champion, _ = registry
    before = versions(client)
    # An artifact root where `runs` is a file: the store is writable (pre-flight passes),
    # but the first checkpoint write, after epoch 1, fails inside the DDP training.
    blocked = project / "blocked-artifacts"
    blocked.mkdir()
    (blocked / "runs").write_text("not a folder")

    result = run_flow("retrain_charlm", ARGS, project, env={"DDPFLOW_ARTIFACT_ROOT": str(blocked)})

    out = result.stdout + result.stderr
    assert result.returncode == 1, out[-4000:]
    assert "retrain-charlm failed" in result.stderr, out[-4000:]
    assert alias(client) == champion
    assert versions(client) == before, "no version registered for a failed challenger"
    (run,) = challenger_runs(client)
    assert run.info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val_loss")] == [1]
    assert not any(k.startswith("ddpflow.retrain.") for k in run.data.tags), run.data.tags


def test_a_challenger_better_by_less_than_the_margin_is_not_promoted(registry) -> None:
    # docs/deployments.md "Retraining": the alias moves only if the loss is lower by more
    # than `margin`.
    project, client, champion, _ = registry
    margin = 50.0  # far more than any loss gap here: nats per symbol, ~3.4 for a uniform guess

    result = run_flow("retrain_charlm", [*ARGS, "--margin", str(margin)], project, env=ONE_WORKER)

    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    run = challenger_runs(client)[0]
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    challenger_loss = float(tags["ddpflow.retrain.challenger_loss"])
    champion_loss = float(tags["ddpflow.retrain.champion_loss"])
    assert tags["ddpflow.retrain.champion_version"] == champion
    assert challenger_loss < champion_loss < challenger_loss + margin, "better, within margin"
    assert tags["ddpflow.retrain.promoted"] == "False"
    assert float(tags["ddpflow.retrain.margin"]) == margin
    assert alias(client) == champion
    assert tags["ddpflow.retrain.challenger_version"] in versions(client), "still registered"
    assert "retraining decision: kept champion" in out
