"""Loading a registered model without letting its files run code.

MLflow's own loader trusts what the registry holds: with `MLFLOW_ALLOW_PICKLE_DESERIALIZATION`
unset it defaults to true, and `torch.export.load` then unpickles (with `weights_only=False`)
any weight record that an archive's config marks `use_pickle`, so a tampered `model.pt2`
runs code in whatever loads it. Two checks stand in the way here, each enough on its own for
the attack it covers:

- the files' digest: at registration ddpflow tags each version with the SHA-256 of its
  model artifact (`MODEL_DIGEST_TAG`, `model_digest` says over what), and the loader
  downloads the files, hashes them and compares before anything is deserialised: files
  changed after registration are refused, naming the model, the version and the tag;
- pickle refused: the load itself runs with `MLFLOW_ALLOW_PICKLE_DESERIALIZATION=false`
  (`pickle_refused`), so MLflow admits only a pt2 archive whose records are plain tensors,
  JSON or text (what ddpflow's export writes), even if someone who can write both the
  artifact store and the version's tags made the digest match a crafted archive.

The model is loaded from the very folder that was hashed (a private temporary one), never
downloaded twice, so what was checked is what is loaded.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from mlflow.artifacts import download_artifacts
from mlflow.environment_variables import MLFLOW_ALLOW_PICKLE_DESERIALIZATION
from mlflow.exceptions import MlflowException
from mlflow.models import Model
from mlflow.tracking import MlflowClient

from ddpflow.registry.read import CHAMPION_ALIAS, RegistryError, alias_version
from ddpflow.storage.redact import error_text, redact_url

if TYPE_CHECKING:
    from torch import nn

MODEL_DIGEST_TAG = "ddpflow.model_sha256"
PICKLE_SETTING = MLFLOW_ALLOW_PICKLE_DESERIALIZATION.name
_HASH_CHUNK = 1 << 20


class ModelDigestMismatch(RegistryError):
    """A registered version's files are not the ones it was registered with (or it has no
    digest to compare them with); nothing was deserialised."""


def model_digest(folder: str | Path) -> str:
    """SHA-256 (hex) of a saved MLflow model: every file of its artifact folder, in a stable
    order.

    "Its model file" is not only `data/model.pt2`: `MLmodel` says which file is loaded, with
    which flavour, and which code folder goes on `sys.path`, so a change there is as much a
    different model. The digest is the SHA-256 of a manifest with one line
    `<sha256 of the file>  <path relative to the folder, with />` per file, sorted by that
    path (code point order), each line ending in a newline: the lines `sha256sum` prints, so
    in the downloaded folder
    `find . -type f -printf '%P\\0' | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum`
    prints the same digest.
    Anything in the folder that is not a regular file or a folder (a link, a FIFO) is refused:
    it has no content to vouch for.
    """
    root = Path(folder)
    lines = [f"{_file_sha256(path)}  {relative}\n" for relative, path in _model_files(root)]
    if not lines:
        raise RegistryError(f"{root} holds no model files")
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def _model_files(root: Path) -> list[tuple[str, Path]]:
    files: list[tuple[str, Path]] = []
    for directory, subdirectories, names in os.walk(root, followlinks=False):
        for name in subdirectories + names:
            path = Path(directory, name)
            mode = path.lstat().st_mode
            if stat.S_ISDIR(mode):
                continue
            if not stat.S_ISREG(mode):
                raise RegistryError(
                    f"{path.relative_to(root).as_posix()} in the model's files is neither a "
                    "regular file nor a folder; a model with links or special files is not "
                    "loaded"
                )
            files.append((path.relative_to(root).as_posix(), path))
    return sorted(files)


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def download_version(client: MlflowClient, model_name: str, version: str, folder: str) -> Path:
    """A version's model artifact, downloaded into `folder` (as stored, nothing added)."""
    # The version's own artifact URI rather than models:/NAME/VERSION: MLflow's models:/
    # download adds a `registered_model_meta` file of its own to what was stored.
    source = client.get_model_version_download_uri(model_name, version)
    local = download_artifacts(
        artifact_uri=source, dst_path=folder, tracking_uri=str(client.tracking_uri)
    )
    return Path(local)


def tag_model_digest(client: MlflowClient, model_name: str, version: str) -> str:
    """Record on a version the digest of its files as stored now; the digest.

    Hashed from a download of what the artifact store holds right after registration, so it
    vouches for the files from that moment on.
    """
    with tempfile.TemporaryDirectory(prefix="ddpflow-model-") as folder:
        digest = model_digest(download_version(client, model_name, version, folder))
    client.set_model_version_tag(model_name, version, MODEL_DIGEST_TAG, digest)
    return digest


# MLflow reads the setting from os.environ at each load (`_BooleanEnvironmentVariable.get`
# in mlflow.environment_variables; mlflow.pytorch's `_is_pickle_deserialization_allowed`),
# so setting it around the load is enough. Scoped rather than process-wide: ddpflow runs
# inside its users' processes (notebooks, Dask workers, flows), and importing it must not
# change how their own MLflow loads behave. The environment is one per process, so the
# scope is counted: the first of concurrent loads (threads of one worker) saves the user's
# value and the last one out restores it, and every entrant sets "false" again. While any
# ddpflow load runs, another thread's MLflow load sees "false" too: stricter than asked,
# never looser. Code that writes the variable itself meanwhile is the one case this cannot
# order.
_pickle_lock = threading.Lock()
_pickle_depth = 0
_pickle_saved: str | None = None


@contextmanager
def pickle_refused() -> Iterator[None]:
    """`MLFLOW_ALLOW_PICKLE_DESERIALIZATION=false` while the block runs; the value it had
    before (or its absence) comes back after the last of overlapping blocks ends."""
    global _pickle_depth, _pickle_saved
    with _pickle_lock:
        if _pickle_depth == 0:
            _pickle_saved = os.environ.get(PICKLE_SETTING)
        _pickle_depth += 1
        os.environ[PICKLE_SETTING] = "false"
    try:
        yield
    finally:
        with _pickle_lock:
            _pickle_depth -= 1
            if _pickle_depth == 0:
                if _pickle_saved is None:
                    os.environ.pop(PICKLE_SETTING, None)
                else:
                    os.environ[PICKLE_SETTING] = _pickle_saved


def load_registered_model(
    tracking_uri: str,
    model_name: str,
    version: str | int | None = None,
    alias: str = CHAMPION_ALIAS,
) -> nn.Module:
    """A registered ddpflow model (`forward(x) -> logits`), loaded without running its files.

    `version`, or else the version `alias` (default `champion`) points to, resolved once so
    the version checked is the version loaded. The version's files are downloaded to a private
    temporary folder, their digest must equal the version's tag `ddpflow.model_sha256`
    (`ModelDigestMismatch` otherwise: a different or missing digest), the `MLmodel` must
    describe a torch.export (pt2) model without code folders, and MLflow loads it with pickle
    refused. Any refusal raises before anything is deserialised.
    """
    client = MlflowClient(tracking_uri)
    where = f"MLflow at {redact_url(tracking_uri)}"
    if version is None:
        found = alias_version(client, model_name, alias)
        if found is None:
            raise RegistryError(
                f"registered model {model_name!r} has no alias {alias!r} in {where}; "
                "pass the version to load"
            )
        version = found
    version = str(version)
    what = f"registered model {model_name!r} version {version}"
    try:
        expected = client.get_model_version(model_name, version).tags.get(MODEL_DIGEST_TAG)
    except MlflowException as error:
        raise RegistryError(f"cannot read {what} from {where}: {error_text(error)}") from None
    if not expected:
        raise ModelDigestMismatch(
            f"{what} has no tag {MODEL_DIGEST_TAG!r}, so its files cannot be checked and it "
            "was not loaded: it was not registered by ddpflow, or before ddpflow recorded "
            "digests. If you trust its files, set the tag to "
            "ddpflow.registry.load.model_digest(<its downloaded folder>)"
        )
    with tempfile.TemporaryDirectory(prefix="ddpflow-model-") as folder:
        try:
            local = download_version(client, model_name, version, folder)
        except MlflowException as error:
            raise RegistryError(
                f"cannot download {what} from {where}: {error_text(error)}"
            ) from None
        actual = model_digest(local)
        if actual != expected:
            raise ModelDigestMismatch(
                f"{what}: its files' SHA-256 is {actual}, but its tag {MODEL_DIGEST_TAG!r} "
                f"says {expected}; the files (or the tag) changed since registration, and "
                "nothing was loaded"
            )
        _check_pt2_without_code(local, what)
        return _load_refusing_pickle(local, what)


def _check_pt2_without_code(local: Path, what: str) -> None:
    """ddpflow registers torch.export models and no code: refuse anything else before MLflow
    reads it (a code folder would go on sys.path for good, shadowing later imports)."""
    try:
        flavor = Model.load(str(local / "MLmodel")).flavors.get("pytorch")
    except Exception as error:  # missing or unreadable MLmodel
        raise RegistryError(f"{what}: cannot read its MLmodel ({error_text(error)})") from None
    if not flavor:
        raise RegistryError(f"{what} is not a PyTorch model (no 'pytorch' flavour in MLmodel)")
    if flavor.get("code"):
        raise RegistryError(
            f"{what} carries code ({flavor['code']!r}), which ddpflow never registers nor loads"
        )
    data = local / str(flavor.get("model_data", ""))
    if not (data / "model.pt2").is_file() or (data / "model.pth").exists():
        raise RegistryError(
            f"{what} is not a torch.export (pt2) model, the only kind ddpflow registers"
        )


def _load_refusing_pickle(local: Path, what: str) -> nn.Module:
    from ddpflow.tracking.mlflow_pytorch import mlflow_pytorch  # torch: loaded on use

    with pickle_refused():
        try:
            return mlflow_pytorch.load_model(str(local))
        except MlflowException as error:
            # MLflow's own refusal of a pickled record, said with the version it belongs to.
            raise RegistryError(f"{what} was refused by MLflow: {error_text(error)}") from None
