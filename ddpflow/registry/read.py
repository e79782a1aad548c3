"""Reading the model registry without trusting it to run code.

A registered version can carry code (`code_paths`, pickled classes) that
`mlflow.<flavor>.load_model` imports; anyone allowed to register a version and move an alias
could run that code in whatever loads the model. ddpflow's flows never load registered
models: every version it registers is tagged with the ddpflow checkpoint it was made from (a
plain state_dict plus model config, read with `torch.load(weights_only=True)`), and that
checkpoint is what gets scored. Versions registered before that tag existed are found
through their source run's latest-checkpoint tag. A user who wants the registered model
itself loads it through `ddpflow.registry.load`, which checks its files' digest and refuses
pickle.
"""

from __future__ import annotations

from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, ErrorCode
from mlflow.tracking import MlflowClient

from ddpflow.checkpoint.store import LATEST_CHECKPOINT_TAG
from ddpflow.storage.redact import redact_text, redact_url

CHAMPION_ALIAS = "champion"
CHECKPOINT_TAG = "ddpflow.checkpoint_uri"
DOES_NOT_EXIST = ErrorCode.Name(RESOURCE_DOES_NOT_EXIST)


class RegistryError(RuntimeError):
    """The registry could not answer, or a version has no checkpoint ddpflow can score."""


def alias_version(client: MlflowClient, model_name: str, alias: str = CHAMPION_ALIAS) -> str | None:
    """The version `alias` points to; None only if the model or the alias does not exist.

    Any other failure (timeout, 5xx, refused credentials) raises: taking it for "no
    champion" would promote whatever comes next.
    """
    try:
        model = client.get_registered_model(model_name)
    except MlflowException as error:
        if error.error_code == DOES_NOT_EXIST:
            return None
        raise RegistryError(
            f"cannot read the {alias!r} alias of registered model {model_name!r} from MLflow "
            f"at {redact_url(client.tracking_uri)}: {_redacted(client, error)}; nothing was "
            "changed, retry when MLflow answers"
        ) from None  # the message carries the cause, without the credentials it may quote
    # Reading the model's alias map, not get_model_version_by_alias: a missing alias is then
    # a plain absence rather than an error code shared with other invalid requests.
    version = model.aliases.get(alias)
    return None if version is None else str(version)


def tag_checkpoint(client: MlflowClient, model_name: str, version: str, uri: str) -> None:
    """Record on a version which ddpflow checkpoint it was registered from."""
    client.set_model_version_tag(model_name, version, CHECKPOINT_TAG, uri)


def version_checkpoint(client: MlflowClient, model_name: str, version: str) -> str:
    """The checkpoint URI a registered version was made from (version tag, else its run's)."""
    try:
        entry = client.get_model_version(model_name, version)
        uri = entry.tags.get(CHECKPOINT_TAG)
        if uri is None and entry.run_id:
            uri = client.get_run(entry.run_id).data.tags.get(LATEST_CHECKPOINT_TAG)
    except MlflowException as error:
        raise RegistryError(
            f"cannot read registered model {model_name!r} version {version} from MLflow at "
            f"{redact_url(client.tracking_uri)}: {_redacted(client, error)}"
        ) from None
    if not uri:
        raise RegistryError(
            f"registered model {model_name!r} version {version} has no ddpflow checkpoint: "
            f"neither the version tag {CHECKPOINT_TAG!r} nor the tag {LATEST_CHECKPOINT_TAG!r} "
            f"on its source run ({entry.run_id or 'none'}). ddpflow scores a version only "
            "from its weights-only checkpoint and never loads code from the registry; "
            f"register versions with ddpflow, or set {CHECKPOINT_TAG!r} on this version to "
            "the URI of its checkpoint"
        )
    return uri


def _redacted(client: MlflowClient, error: Exception) -> str:
    """MLflow quotes the request URL, which carries any user:password of the tracking URI."""
    uri = str(client.tracking_uri)
    # The literal replace first, for a password redact_text cannot delimit (one with a quote).
    return redact_text(str(error).replace(uri, redact_url(uri)))
