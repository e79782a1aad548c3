"""retrain-charlm against a registry that already has a champion.

The flow runs in the test's process on the module's flow_services (a Prefect API and a
2-worker Dask cluster), with an MLflow SQLite registry. The champion
is registered by the test with a known, poor holdout loss (a constant prediction, no
training), so a 1-epoch challenger is certain to score better.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from ddpflow.workloads.charlm.champion import CHAMPION_ALIAS
from flows.params import RetrainParams
from flows.retrain_charlm import retrain_charlm
from tests.helpers.champion_helpers import (
    add_version,
    constant_model,
    peaked_bias,
    unigram_bias,
    write_holdout,
)
from tests.helpers.charlm_runs import SMALL_SOURCE
from tests.helpers.in_process import run_in_process

pytestmark = pytest.mark.integration
MODEL = "retrain-test-model"
EXPERIMENT = "retrain-test"
ARTIFACT_ROOT = "DDPFLOW_ARTIFACT_ROOT"
TINY = {
    "source": SMALL_SOURCE, "epochs": 1, "hidden_size": 16, "num_layers": 1, "batch_size": 2048,
    "lr": 0.01, "num_names": 2, "max_restarts": 0, "model_name": MODEL, "experiment": EXPERIMENT,
}  # fmt: skip


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


def test_a_challenger_whose_training_fails_leaves_the_champion_alone(
    registry, flow_services, monkeypatch
) -> None:
    # docs/deployments.md "Retraining": a challenger that fails stops the flow before the decision,
    # so it never touches the alias.
    project, client, champion, _ = registry
    before = versions(client)
    # An artifact root where `runs` is a file: the store is writable (pre-flight passes),
    # but the first checkpoint write, after epoch 1, fails inside the DDP training.
    blocked = project / "blocked-artifacts"
    blocked.mkdir()
    (blocked / "runs").write_text("not a folder")

    with pytest.raises(Exception) as failed:  # noqa: PT011 - whatever the store raised
        run_in_process(
            retrain_charlm,
            project,
            flow_services,
            monkeypatch,
            env={ARTIFACT_ROOT: str(blocked)},
            training=RetrainParams(**TINY),
        )
    assert "runs" in str(failed.value), failed.value
    assert alias(client) == champion
    assert versions(client) == before, "no version registered for a failed challenger"
    (run,) = challenger_runs(client)
    assert run.info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val_loss")] == [1]
    assert not any(k.startswith("ddpflow.retrain.") for k in run.data.tags), run.data.tags


def test_a_challenger_better_by_less_than_the_margin_is_not_promoted(
    registry, flow_services, monkeypatch
) -> None:
    # docs/deployments.md "Retraining": the alias moves only if the loss is lower by more
    # than `margin`.
    project, client, champion, _ = registry
    margin = 50.0  # far more than any loss gap here: nats per symbol, ~3.4 for a uniform guess

    # A 1-rank DDP group: what is tested is the rule.
    training = RetrainParams(**TINY, margin=margin, world_size=1)
    decision = run_in_process(
        retrain_charlm, project, flow_services, monkeypatch, training=training
    )

    assert not decision.promoted, decision
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
