"""The logging thread's MLflow calls, each tried once: no retries inside MLflow's client.

MLflow's client retries a call whose server is gone inside urllib3, sleeping 4, 8, 16 ... up
to 120 s between tries (MLFLOW_HTTP_REQUEST_MAX_RETRIES 7, MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR
2), and reads that policy only from the process environment, so there is no setting for one
thread. A call in flight when the server stopped therefore went in up to two minutes after
the server was back, and every call behind it (and the end of training) waited. The logging
thread needs none of those retries: it keeps each call on disk until MLflow takes it and
retries on its own, at most `retry_max_s` apart. So its calls to an http(s) tracking server
go through MLflow's own request function with `max_retries=0`: a server gone mid-call fails
the call at once. The rest of the process (a user's own MLflow calls on rank 0) keeps MLflow's
retries.

Other stores go through MlflowClient as before: a SQLite or folder store has no server, and an
artifact store MLflow does not proxy (S3) is reached with its own client's bounded retries.
"""

from __future__ import annotations

import json
import mimetypes
import os
import posixpath
from collections.abc import Sequence
from typing import Any

from google.protobuf.message import Message
from mlflow.entities import Metric, RunTag
from mlflow.environment_variables import MLFLOW_HTTP_REQUEST_TIMEOUT
from mlflow.protos.service_pb2 import GetMetricHistory, GetRun, LogBatch
from mlflow.store.artifact.artifact_repo import ArtifactRepository
from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository
from mlflow.store.artifact.http_artifact_repo import HttpArtifactRepository
from mlflow.store.tracking import GET_METRIC_HISTORY_MAX_RESULTS
from mlflow.tracking import MlflowClient
from mlflow.utils.credentials import get_default_host_creds
from mlflow.utils.proto_json_utils import message_to_json, parse_dict
from mlflow.utils.request_utils import augmented_raise_for_status
from mlflow.utils.rest_utils import http_request, verify_rest_response

# MLflow's REST API (the paths its RestStore calls).
LOG_BATCH = "/api/2.0/mlflow/runs/log-batch"
GET_METRIC_HISTORY = "/api/2.0/mlflow/metrics/get-history"
GET_RUN = "/api/2.0/mlflow/runs/get"
# A tracking server that does not accept a connection in this time is taken as down: the
# thread tries again within retry_max_s. Reading an answer may take MLflow's usual timeout.
CONNECT_TIMEOUT_S = 5.0


def timeouts() -> tuple[float, float]:
    return CONNECT_TIMEOUT_S, float(MLFLOW_HTTP_REQUEST_TIMEOUT.get())


def is_server(tracking_uri: str) -> bool:
    return tracking_uri.split(":", 1)[0] in ("http", "https")


class OneTryCalls:
    """log_batch, a metric's logged steps and log_artifact for one run, each tried once
    against an http(s) tracking server (and the artifacts it proxies), or through
    MlflowClient for any other store."""

    def __init__(self, tracking_uri: str, run_id: str):
        self.run_id = run_id
        self._tracking_uri = tracking_uri
        self._client = MlflowClient(tracking_uri)
        self._server = is_server(tracking_uri)
        # Resolved at the first artifact: it costs a call.
        self._artifact_repo: ArtifactRepository | None = None

    def log_batch(self, metrics: Sequence[Metric] = (), tags: Sequence[RunTag] = ()) -> None:
        if not self._server:
            self._client.log_batch(self.run_id, metrics=list(metrics), tags=list(tags))
            return
        request = LogBatch(
            run_id=self.run_id,
            metrics=[m.to_proto() for m in metrics],
            tags=[t.to_proto() for t in tags],
        )
        self._call(LOG_BATCH, "POST", request)

    def logged_steps(self, key: str) -> list[int]:
        """Every step MLflow holds for metric `key` of the run."""
        if not self._server:
            return [m.step for m in self._client.get_metric_history(self.run_id, key)]
        steps: list[int] = []
        token = None
        while True:
            request = GetMetricHistory(
                run_id=self.run_id,
                metric_key=key,
                max_results=GET_METRIC_HISTORY_MAX_RESULTS,  # what MlflowClient asks for
                page_token=token,
            )
            page = self._call(GET_METRIC_HISTORY, "GET", request)
            steps += [m.step for m in page.metrics]
            if not page.next_page_token:
                return steps
            token = page.next_page_token

    def log_artifact(self, local_file: str, artifact_path: str | None) -> None:
        repo = self._repo()
        if not isinstance(repo, HttpArtifactRepository) or repo._should_multipart_upload(
            local_file
        ):  # a store MLflow does not proxy, or a file MLflow uploads in parts
            repo.log_artifact(local_file, artifact_path)
            return
        # What HttpArtifactRepository.log_artifact sends, with one try.
        name = os.path.basename(local_file)
        endpoint = posixpath.join("/", *(p for p in (artifact_path, name) if p))
        mime = mimetypes.guess_type(name)[0] or "application/octet-stream"
        creds = get_default_host_creds(repo.artifact_uri)
        with open(local_file, "rb") as data:
            response = http_request(
                creds, endpoint, "PUT", max_retries=0, timeout=timeouts(),
                data=data, extra_headers={"Content-Type": mime},
            )  # fmt: skip
        augmented_raise_for_status(response)

    def keep_artifacts(self, artifact_path: str, names: Sequence[str]) -> None:
        """Delete the run's files directly in `artifact_path` whose names are not `names`.

        Through the artifact repository's own delete (a tracking server's proxied
        artifacts take a DELETE per file): so the checkpoints MLflow holds follow the
        checkpoint store's `keep_last` instead of growing by one per epoch."""
        repo = self._repo()
        for info in repo.list_artifacts(artifact_path):
            if not info.is_dir and posixpath.basename(info.path) not in names:
                repo.delete_artifacts(info.path)

    def _repo(self) -> Any:
        if self._artifact_repo is None:
            if self._server:
                uri = self._call(GET_RUN, "GET", GetRun(run_id=self.run_id)).run.info.artifact_uri
            else:
                uri = self._client.get_run(self.run_id).info.artifact_uri
            self._artifact_repo = get_artifact_repository(uri, tracking_uri=self._tracking_uri)
        return self._artifact_repo

    def _call(self, endpoint: str, method: str, request: Message) -> Any:
        body = json.loads(message_to_json(request))
        where = {"params": body} if method == "GET" else {"json": body}
        creds = get_default_host_creds(self._tracking_uri)
        response = http_request(creds, endpoint, method, max_retries=0, timeout=timeouts(), **where)
        response = verify_rest_response(response, endpoint)
        answer = request.Response()  # MLflow's generated messages name their response type
        parse_dict(js_dict=response.json(), message=answer)
        return answer
