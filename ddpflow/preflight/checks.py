"""Pre-flight: prove each component works before any expensive or stateful work starts.

Each check fails within seconds with a message naming the component, what was tried and the
setting to fix. None of them leaves anything behind: the artifact-store probe is deleted,
and a failed probe wrote nothing.
"""

from __future__ import annotations

import base64
import concurrent.futures
import http.client
import json
import os
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

from ddpflow import storage
from ddpflow.config import ARTIFACT_ROOT_ENV, TRACKING_URI_ENV
from ddpflow.preflight.folder_probe import probe_folder
from ddpflow.preflight.http_probe import API_PROBE_TIMEOUT_S, probe_http, probe_http_off_loop
from ddpflow.storage.redact import clean_cause, redact_text

__all__ = [
    "API_PROBE_TIMEOUT_S",
    "PreflightError",
    "check_artifact_store",
    "check_tracking",
    "check_workers_reach",
    "check_workers_reach_api",
    "probe_http",
    "probe_http_off_loop",
]

T = TypeVar("T")
DEFAULT_TIMEOUT_S = 15.0
API_FIX = (
    "Start a Prefect server on an address the workers reach and set PREFECT_API_URL for the "
    "flow, e.g. `prefect server start --host 0.0.0.0` and "
    "PREFECT_API_URL=http://<this host>:4200/api (the workers need no setting of their own)."
)


class PreflightError(RuntimeError):
    """A component is unusable; the run stopped before doing anything.

    The message is redacted when the error is made: it names URIs (a tracking URI may
    carry user:password@), and it ends up in the terminal and in Prefect's flow state.
    """

    def __init__(self, message: str) -> None:
        super().__init__(redact_text(message))


def check_artifact_store(root: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """A local root must be creatable and writable; a remote one gets a probe round trip.

    The local check writes nothing (no probe, no folders). For an object store, permission
    is only known by trying, so a small probe object is written, read back and deleted.
    """
    if "://" not in root:
        _check_local_root(Path(root))
        return
    probe = storage.join(root, ".ddpflow-preflight", uuid.uuid4().hex)
    payload = b"ddpflow pre-flight probe"

    def roundtrip() -> None:
        _require_bucket(root)
        storage.write_bytes(probe, payload)
        try:
            if storage.read_bytes(probe, len(payload) + 1) != payload:
                raise OSError("read back different bytes than written")
        finally:
            storage.delete(probe)

    try:
        _bounded(roundtrip, timeout_s)
    except Exception as error:  # noqa: BLE001 - every failure becomes one clear message
        raise PreflightError(_artifact_store_message(root, error)) from clean_cause(error)


def check_tracking(tracking_uri: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """An MLflow server answers its health and API endpoints; a SQLite file's folder exists."""
    if tracking_uri.startswith("sqlite:///"):
        folder = Path(tracking_uri.removeprefix("sqlite:///")).parent
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise PreflightError(
                f"MLflow store {tracking_uri}: folder {folder} does not exist or is not "
                f"writable. Create it or set {TRACKING_URI_ENV}."
            )
        return
    if not tracking_uri.startswith(("http://", "https://")):
        return  # other stores (databricks, file:) are left to MLflow itself
    base = tracking_uri.rstrip("/")
    plain, headers = _basic_auth(base)
    tried = f"{plain}/api/2.0/mlflow/experiments/search"
    try:
        # A direct bounded request: MLflow's own client retries a dead server for minutes.
        request = urllib.request.Request(
            tried,
            data=json.dumps({"max_results": 1}).encode(),
            method="POST",
            headers={"Content-Type": "application/json", **(headers or _mlflow_auth_headers())},
        )
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            json.loads(response.read() or b"{}")
    # http.client.InvalidURL (not a ValueError): a password with an unencoded / # or ?.
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as error:
        reason = getattr(error, "reason", None) or error
        fix = f"Start the server or fix {TRACKING_URI_ENV}."
        if getattr(error, "code", None) in (401, 403):
            fix = "Set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or a token)."
        if isinstance(error, http.client.InvalidURL):
            fix = (
                f"Its host and port cannot be parsed: percent-encode a / # ? or @ in the user "
                f"or password of {TRACKING_URI_ENV} (or set MLFLOW_TRACKING_USERNAME and "
                "MLFLOW_TRACKING_PASSWORD instead)."
            )
        raise PreflightError(
            redact_text(
                f"MLflow tracking server {base} is not usable: POST {tried} failed ({reason}). "
                f"{fix}"
            )
        ) from clean_cause(error)


def _basic_auth(url: str) -> tuple[str, dict[str, str]]:
    """The URL without user:password@, and the Authorization header that carries them.

    MLflow's client (requests) sends URL credentials as basic auth; urllib would instead
    take them for part of the host name.
    """
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return url, {}
    userinfo, _, host = parts.netloc.rpartition("@")
    user, _, password = (urllib.parse.unquote(p) for p in userinfo.partition(":"))
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    plain = urllib.parse.urlunsplit(parts._replace(netloc=host))
    return plain, {"Authorization": f"Basic {token}"}


def _mlflow_auth_headers() -> dict[str, str]:
    """The credentials MLflow's own client would send (basic auth, or a bearer token)."""
    user = os.environ.get("MLFLOW_TRACKING_USERNAME")
    password = os.environ.get("MLFLOW_TRACKING_PASSWORD")
    if user and password:
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        return {"Authorization": f"Basic {token}"}
    if os.environ.get("MLFLOW_TRACKING_TOKEN"):
        return {"Authorization": f"Bearer {os.environ['MLFLOW_TRACKING_TOKEN']}"}
    return {}


def check_workers_reach_api(
    api_url: str,
    probe_workers: Callable[[str, float], Mapping[str, object]],
    timeout_s: float = API_PROBE_TIMEOUT_S,
    embedded: bool = False,
) -> None:
    """Every worker must reach the API its tasks report to.

    probe_workers(health_url, timeout_s) runs a probe on each worker and returns, per worker,
    None (reachable), the reason it is not, or the exception the probe raised there.
    """
    health_url = f"{api_url.rstrip('/')}/health"
    what = f"the flow's embedded Prefect API {api_url}" if embedded else f"Prefect API {api_url}"
    check_workers_reach(
        what,
        f"where their Prefect task runs are recorded; GET {health_url} failed",
        lambda: probe_workers(health_url, timeout_s),
        API_FIX,
    )


def check_workers_reach(
    what: str, why: str, probe_workers: Callable[[], Mapping[str, object]], fix: str
) -> None:
    """Every worker must reach `what`; probe_workers() answers per worker: None (reached),
    the reason it did not, or the exception the probe raised there."""
    try:
        answers = probe_workers()
    except Exception as error:  # noqa: BLE001 - a probe that cannot run is a failed check
        # A worker that cannot answer a probe in time cannot run a task either.
        raise PreflightError(
            f"could not ask every Dask worker whether it reaches {what} "
            f"({type(error).__name__}: {error}). Check that the workers are running and "
            f"responsive; if they are and cannot reach it: {fix}"
        ) from clean_cause(error)
    failed = {
        worker: answer if isinstance(answer, str) else f"{type(answer).__name__}: {answer}"
        for worker, answer in sorted(answers.items())
        if answer is not None
    }
    if failed:
        reasons = "; ".join(f"{worker}: {reason}" for worker, reason in failed.items())
        raise PreflightError(
            f"{len(failed)} of {len(answers)} Dask workers cannot reach {what}, {why} "
            f"({reasons}). {fix}"
        )


def _check_local_root(root: Path) -> None:
    # The same check the workers of a remote cluster run on their side (flows.preflight).
    reason = probe_folder(str(root))
    if reason:
        raise PreflightError(
            f"artifact store {root}: {reason}, so the root cannot be created or written. "
            f"Make it writable or set {ARTIFACT_ROOT_ENV}."
        )


def _bounded(fn: Callable[[], T], timeout_s: float) -> T:
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        return pool.submit(fn).result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise TimeoutError(f"no answer within {timeout_s:g}s") from None
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _require_bucket(root: str) -> None:
    """FileNotFoundError unless the root's bucket exists: some S3 servers (SeaweedFS) make a
    missing bucket on an administrator's first write, so a mistyped name would pass the
    probe and leave a new bucket behind."""
    if not root.startswith(("s3://", "s3a://")):
        return
    fs, path = storage.url_to_fs(root)
    bucket = path.split("/", 1)[0]
    fs.invalidate_cache(bucket)
    fs.info(bucket)  # HeadBucket: FileNotFoundError when missing, PermissionError when not ours


def _artifact_store_message(root: str, error: BaseException) -> str:
    kind = type(error).__name__
    detail = f"{kind}: {error}" if str(error) else kind
    tried = f"artifact store {root}: writing a probe object failed ({detail})."
    if not root.startswith("s3://"):
        return f"{tried} Make the folder writable or set {ARTIFACT_ROOT_ENV}."
    bucket = root.removeprefix("s3://").split("/", 1)[0]
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    where = f" at {endpoint} (AWS_ENDPOINT_URL_S3)" if endpoint else ""
    if kind == "NoCredentialsError":
        fix = "No AWS credentials were found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY."
    elif isinstance(error, PermissionError):
        fix = (
            "Access denied: check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and the "
            f"permissions on bucket '{bucket}'."
        )
    elif isinstance(error, FileNotFoundError):
        fix = f"Bucket '{bucket}' does not exist{where}: create it or fix {ARTIFACT_ROOT_ENV}."
    elif isinstance(error, TimeoutError) or "Connect" in kind or "Endpoint" in kind:
        fix = f"The S3 endpoint{where or ''} is unreachable: check AWS_ENDPOINT_URL_S3."
    else:
        fix = f"Check {ARTIFACT_ROOT_ENV} and the AWS_* settings."
    return f"{tried} {fix}"
