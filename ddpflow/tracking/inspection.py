"""What a user reads in the MLflow UI about a training: its data, its origin, its model.

- the input datasets of a run (train and holdout), each with its URI, credentials removed,
  and a digest of its content, so runs on the same data show the same digest;
- a run description (markdown note) and the standard source tags: which Prefect flow run
  trained it, with which code (git commit when the code is a git checkout);
- a registered version's description and tags: what it is, its data, its key metrics, a
  link to its run, its workload; and the champion/challenger decision on both versions.

Everything written here goes through `redact_url`: no credential reaches MLflow.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mlflow.entities import Dataset, DatasetInput, InputTag
from mlflow.tracking import MlflowClient

from ddpflow import storage
from ddpflow.storage.redact import redact_url
from ddpflow.tracking.loggers import RunRef

NOTE_TAG = "mlflow.note.content"  # the run's (and experiment's) description in the UI
SOURCE_NAME_TAG = "mlflow.source.name"
SOURCE_TYPE_TAG = "mlflow.source.type"
GIT_COMMIT_TAG = "mlflow.source.git.commit"
CONTEXT_TAG = "mlflow.data.context"  # the UI's label on a dataset: training, validation ...
ORIGIN_TAG = "ddpflow.data.origin"
WORKLOAD_TAG = "ddpflow.workload"
DIGEST_LEN = 32  # hex characters of the sha256; MLflow's column holds 36
HASH_CHUNK = 1 << 20
# Metrics worth a tag on a registered version, in the order the description lists them.
KEY_METRICS = ("final_val_loss", "final_val_accuracy", "novel_name_fraction", "val_loss")


@dataclass(frozen=True)
class DatasetRef:
    """One input of a training: a file in the artifact store and what it holds."""

    name: str
    uri: str
    sha256: str
    context: str  # "training" or "validation"
    origin: str | None = None  # the user's source it was made from
    profile: Mapping[str, int | str] = field(default_factory=dict)  # e.g. {"samples": 1234}

    @property
    def digest(self) -> str:
        return self.sha256[:DIGEST_LEN]


def content_sha256(uri: str) -> str:
    """sha256 of a file in the artifact store, read in chunks (it may be large)."""
    fs, path = storage.url_to_fs(uri)
    digest = hashlib.sha256()
    with fs.open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def dataset_ref(
    name: str,
    uri: str,
    context: str,
    origin: str | None = None,
    profile: Mapping[str, int | str] | None = None,
) -> DatasetRef:
    return DatasetRef(name, uri, content_sha256(uri), context, origin, dict(profile or {}))


def _source(uri: str) -> tuple[str, str]:
    """MLflow's (source_type, source JSON) for a URI, as its own dataset sources write them."""
    shown = redact_url(uri)
    if shown.startswith(("http://", "https://")):
        return "http", json.dumps({"url": shown})
    scheme = shown.split("://", 1)[0] if "://" in shown else "local"
    return ("local" if scheme == "file" else scheme), json.dumps({"uri": shown})


def log_datasets(run: RunRef, datasets: Sequence[DatasetRef]) -> None:
    """Record the run's inputs (the Datasets column and the run page's Datasets box)."""
    inputs = []
    for ref in datasets:
        source_type, source = _source(ref.uri)
        profile = {**ref.profile, "sha256": ref.sha256}
        entity = Dataset(ref.name, ref.digest, source_type, source, profile=json.dumps(profile))
        tags = [InputTag(CONTEXT_TAG, ref.context)]
        if ref.origin:
            tags.append(InputTag(ORIGIN_TAG, redact_url(ref.origin)))
        inputs.append(DatasetInput(entity, tags))
    MlflowClient(run.tracking_uri).log_inputs(run.run_id, datasets=inputs)


def git_commit(path: Path | None = None) -> str | None:
    """The commit of the checkout the code runs from (+"-dirty" with local changes), or None."""
    where = path or Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "-C", str(where), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}-dirty" if head and status else head or None


@dataclass(frozen=True)
class RunOrigin:
    """Who started a training: its Prefect flow run and the code version."""

    flow_name: str
    flow_run_name: str | None
    flow_run_id: str | None
    flow_run_url: str | None  # None without a Prefect UI (the embedded API has none)
    commit: str | None

    def tags(self) -> dict[str, str]:
        tags = {SOURCE_NAME_TAG: self.flow_name, SOURCE_TYPE_TAG: "JOB"}
        if self.commit:
            tags[GIT_COMMIT_TAG] = self.commit
        return tags


def run_description(
    origin: RunOrigin, what: str, datasets: Sequence[DatasetRef] = (), extra: str = ""
) -> str:
    """The run's markdown description."""
    if origin.flow_run_url:
        flow_run = f"[{origin.flow_run_name}]({redact_url(origin.flow_run_url)})"
    else:
        flow_run = f"**{origin.flow_run_name}** (id `{origin.flow_run_id}`)"
    lines = [
        f"{what}, trained by the Prefect flow `{origin.flow_name}`, flow run {flow_run}.",
        "",
        f"- code: git commit `{origin.commit}`" if origin.commit else "- code: not a git checkout",
    ]
    lines += [f"- {d.context} data: `{redact_url(d.uri)}` (digest `{d.digest}`)" for d in datasets]
    if extra:
        lines += ["", extra]
    return "\n".join(lines) + "\n"


def describe_run(run: RunRef, description: str) -> None:
    MlflowClient(run.tracking_uri).set_tag(run.run_id, NOTE_TAG, description)


# MLflow 3.17's UI opens in its GenAI mode (traces, an assistant) for a browser that has
# not picked a mode, whatever the experiment's `mlflow.experimentKind` tag says; this query
# parameter selects its "Model training" mode, as a click on it would.
TRAINING_VIEW = "?workflowType=machine_learning"


def run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """The run's page in the MLflow UI's training view, or a `runs:/` URI when the store has
    no UI address."""
    base = redact_url(tracking_uri).rstrip("/")
    if base.startswith(("http://", "https://")):
        return f"{base}/#/experiments/{experiment_id}/runs/{run_id}{TRAINING_VIEW}"
    return f"runs:/{run_id}"


def experiment_url(tracking_uri: str, experiment_id: str) -> str:
    """The experiment's runs table in the MLflow UI, or its id when the store has no UI."""
    base = redact_url(tracking_uri).rstrip("/")
    if base.startswith(("http://", "https://")):
        return f"{base}/#/experiments/{experiment_id}{TRAINING_VIEW}"
    return f"experiment {experiment_id}"


def model_version_url(tracking_uri: str, model_name: str, version: str) -> str:
    base = redact_url(tracking_uri).rstrip("/")
    if base.startswith(("http://", "https://")):
        return f"{base}/#/models/{model_name}/versions/{version}{TRAINING_VIEW}"
    return f"models:/{model_name}/{version}"


def describe_version(run: RunRef, model_name: str, version: str) -> dict[str, str]:
    """Write what the registered version is onto it: description and tags, from its run.

    Everything comes from the run (workload tag, input digests, final metrics), so any flow
    that registers a run's model calls just this. Returns the tags written.
    """
    client = MlflowClient(run.tracking_uri)
    source = client.get_run(run.run_id)
    workload = source.data.tags.get(WORKLOAD_TAG, "unknown")
    metrics = {k: source.data.metrics[k] for k in KEY_METRICS if k in source.data.metrics}
    inputs = source.inputs.dataset_inputs if source.inputs else []
    link = run_url(run.tracking_uri, source.info.experiment_id, run.run_id)
    tags = {
        WORKLOAD_TAG: workload,
        "ddpflow.run_link": link,
        "ddpflow.run_id": run.run_id,
        **{f"metric.{k}": f"{v:.4f}" for k, v in metrics.items()},
        **{
            f"data.{_context(i)}.digest": i.dataset.digest
            for i in inputs
            if _context(i) is not None
        },
    }
    data = [f"- {_context(i)}: `{i.dataset.name}`, digest `{i.dataset.digest}`" for i in inputs]
    scores = [f"- {k}: {v:.4f}" for k, v in metrics.items()]
    description = "\n".join(
        [
            f"A `{workload}` model registered by ddpflow from MLflow run "
            f"[{source.info.run_name or run.run_id}]({link}).",
            "",
            "Data:",
            *(data or ["- (no input datasets recorded)"]),
            "",
            "Key metrics:",
            *(scores or ["- (none recorded)"]),
        ]
    )
    client.update_model_version(model_name, version, description=description + "\n")
    for key, value in tags.items():
        client.set_model_version_tag(model_name, version, key, value)
    return tags


def _context(dataset_input: DatasetInput) -> str | None:
    return next((t.value for t in dataset_input.tags if t.key == CONTEXT_TAG), None)


DECISION_PREFIX = "ddpflow.retrain."


def record_decision_on_versions(
    client: MlflowClient,
    model_name: str,
    decision_tags: Mapping[str, str],
    challenger_version: str,
    champion_version: str | None,
) -> None:
    """The champion/challenger decision, on the challenger and on the champion it faced."""
    roles = {challenger_version: "challenger"}
    if champion_version is not None and champion_version != challenger_version:
        roles[champion_version] = "champion"
    for version, role in roles.items():
        for key, value in decision_tags.items():
            client.set_model_version_tag(model_name, version, key, value)
        client.set_model_version_tag(model_name, version, f"{DECISION_PREFIX}role", role)
