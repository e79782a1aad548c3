"""The champion is scored from its weights-only checkpoint; registry code never runs.

A real MLflow registry on SQLite holds a champion whose registered model ships a `code/`
module that writes a marker file when imported (as `mlflow.pytorch.load_model` would do).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import traceback
from pathlib import Path

import mlflow
import mlflow.pytorch
import pytest
import torch
from mlflow.tracking import MlflowClient

from ddpflow.registry.read import RegistryError, tag_checkpoint
from ddpflow.workloads.charlm.champion import CHAMPION_ALIAS, promote, score_version
from infra.procs import free_port
from tests.helpers.champion_helpers import (
    add_version,
    constant_model,
    expected_loss,
    start_checkpointed_run,
    unigram_bias,
    write_holdout,
)

pytestmark = pytest.mark.integration

PAYLOAD = """
import pathlib
import torch

pathlib.Path({marker!r}).write_text("registry code ran")

class Payload(torch.nn.Module):
    def forward(self, x):
        return torch.zeros(x.shape[0], x.shape[1], 31)
"""


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> tuple[str, str, Path]:
    """(tracking URI, holdout URI, scratch folder) shared by this module's tests."""
    folder = tmp_path_factory.mktemp("registry")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    MlflowClient(uri).search_experiments()  # creates the schema once (several seconds)
    return uri, write_holdout(folder), folder


def register_payload(uri: str, name: str, run_id: str, folder: Path) -> tuple[str, Path]:
    """Log a pickled model whose class lives in a `code/` module that leaves a marker."""
    marker = folder / f"marker-{name}"
    module_dir = folder / f"code-{name}"
    module_dir.mkdir()
    module = module_dir / f"payload_{name.replace('-', '_')}.py"
    module.write_text(textwrap.dedent(PAYLOAD.format(marker=str(marker))))
    sys.path.insert(0, str(module_dir))
    try:
        payload = __import__(module.stem).Payload()
        mlflow.set_tracking_uri(uri)
        with mlflow.start_run(run_id=run_id):
            info = mlflow.pytorch.log_model(
                payload,
                name="model",
                code_paths=[str(module)],
                serialization_format="pickle",
                pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"],
                registered_model_name=name,
            )
    finally:
        sys.path.remove(str(module_dir))
        sys.modules.pop(module.stem, None)
    marker.unlink()  # logging imported it here; only a later import may recreate it
    return str(info.registered_model_version), marker


def assert_payload_runs_when_loaded(uri: str, name: str, version: str, marker: Path) -> None:
    """The payload is live: MLflow's own loader, in a fresh process, does run it."""
    load = f"import mlflow.pytorch; mlflow.pytorch.load_model('models:/{name}/{version}')"
    env_uri = f"import mlflow; mlflow.set_tracking_uri({uri!r}); {load}"
    subprocess.run([sys.executable, "-c", env_uri], check=True, capture_output=True, timeout=120)
    assert marker.exists()


def test_champion_with_a_code_payload_is_scored_without_running_it(registry):
    uri, val_uri, folder = registry
    client = MlflowClient(uri)
    name = "payload-champion"
    good = unigram_bias(val_uri)
    run_id = start_checkpointed_run(client, constant_model(good), folder)
    champion, marker = register_payload(uri, name, run_id, folder)
    client.set_registered_model_alias(name, CHAMPION_ALIAS, champion)
    challenger, challenger_run = add_version(client, name, constant_model(good * 0), folder)

    decision = promote(uri, name, challenger_run, challenger, val_uri, margin=0.0)

    assert not marker.exists(), "scoring the champion imported code from the registry"
    assert decision.champion_version == champion
    assert decision.champion_loss == pytest.approx(expected_loss(good, val_uri), rel=1e-5)
    assert decision.challenger_loss == pytest.approx(expected_loss(good * 0, val_uri), rel=1e-5)
    assert not decision.promoted
    assert str(client.get_model_version_by_alias(name, CHAMPION_ALIAS).version) == champion
    assert_payload_runs_when_loaded(uri, name, champion, marker)


def test_champion_without_a_checkpoint_fails_clearly_and_keeps_the_alias(registry):
    uri, val_uri, folder = registry
    client = MlflowClient(uri)
    name = "uncheckpointed-champion"
    experiment_id = client.get_experiment_by_name("champion-tests").experiment_id
    bare_run = client.create_run(experiment_id).info.run_id
    champion, marker = register_payload(uri, name, bare_run, folder)
    client.set_registered_model_alias(name, CHAMPION_ALIAS, champion)
    challenger, challenger_run = add_version(client, name, constant_model(torch.zeros(31)), folder)

    with pytest.raises(RegistryError, match=f"version {champion} has no ddpflow checkpoint"):
        promote(uri, name, challenger_run, challenger, val_uri, margin=0.0)

    assert not marker.exists(), "a missing checkpoint fell back to loading registry code"
    assert str(client.get_model_version_by_alias(name, CHAMPION_ALIAS).version) == champion


@pytest.mark.parametrize(
    ("checkpoint", "shown"),
    [
        # Nothing listens on the port: the read fails at once.
        (
            "http://alice:CkptS3cret@127.0.0.1:{port}/c/ckpt.pt?X-Amz-Signature=SIGV4X",
            "http://alice:***@127.0.0.1:{port}/c/ckpt.pt?X-Amz-Signature=***",
        ),
        # fsspec's FileNotFoundError quotes the path, credentials and query included.
        (
            "memory://alice:CkptS3cret@bucket.example/c/ckpt.pt?sig=SIGV4X",
            "memory://alice:***@bucket.example/c/ckpt.pt?sig=***",
        ),
    ],
)
def test_a_champion_checkpoint_uri_with_credentials_is_never_shown(registry, checkpoint, shown):
    """A version tagged (by hand, or by an older ddpflow) with a credentialed checkpoint URI:
    the scoring error names it redacted, and the error it wraps, if it quotes it, is dropped."""
    uri, val_uri, folder = registry
    client = MlflowClient(uri)
    name = f"credentialed-champion-{checkpoint.split(':')[0]}"
    champion, _ = add_version(client, name, constant_model(torch.zeros(31)), folder)
    port = free_port()
    tag_checkpoint(client, name, champion, checkpoint.format(port=port))

    with pytest.raises(RegistryError) as info:
        score_version(client, name, champion, val_uri)

    printed = "".join(traceback.format_exception(info.value))
    assert shown.format(port=port) in printed
    assert "CkptS3cret" not in printed and "SIGV4X" not in printed, printed
