"""The download task's source handling over a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import base64
import json
import logging
import threading
import traceback
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ddpflow import storage
from ddpflow.workloads.charlm.corpus import DEFAULT_CORPUS_PATH
from ddpflow.workloads.charlm.data import fetch_corpus
from tests.helpers.s3_servers import s3_client, without_aws_credentials

pytestmark = pytest.mark.integration
BODY = DEFAULT_CORPUS_PATH.read_bytes()
PASSWORD, KEY = "Pw-7q1xZ", "Kx-93vQ"  # distinctive, so a leak cannot be a coincidence
BUCKET = "ddpflow-public"  # the conftest's `s3_endpoint` fixture creates it
# What makes an object public on S3 today (AWS turns object ACLs off in new buckets, and
# SeaweedFS 4.48 ignores a public-read ACL for anonymous reads): a bucket policy.
PUBLIC_PETS = {
    "Version": "2012-10-17",
    "Statement": [
        {
            "Effect": "Allow",
            "Principal": "*",
            "Action": "s3:GetObject",
            "Resource": f"arn:aws:s3:::{BUCKET}/pets/*",
        }
    ],
}


class FlakyServer(ThreadingHTTPServer):
    """Serves /names.json, failing the first `failures` requests with 503."""

    def __init__(self, failures: int, auth: str | None = None):
        super().__init__(("127.0.0.1", 0), FlakyHandler)
        self.failures = failures
        self.auth = auth  # "user:password" the server demands (basic auth), or None
        self.requests: list[tuple[str, str, int]] = []


class FlakyHandler(BaseHTTPRequestHandler):
    server: FlakyServer

    def _respond(self, with_body: bool) -> None:
        auth = self.server.auth
        wanted = f"Basic {base64.b64encode(auth.encode()).decode()}" if auth else None
        if wanted and self.headers.get("Authorization") != wanted:
            status = 401
        elif self.path.split("?")[0] != "/names.json":
            status = 404
        elif self.server.failures > 0:
            self.server.failures -= 1
            status = 503
        else:
            status = 200
        self.server.requests.append((self.command, self.path, status))
        self.send_response(status)
        self.send_header("Content-Length", str(len(BODY) if status == 200 else 0))
        self.end_headers()
        if with_body and status == 200:
            self.wfile.write(BODY)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._respond(with_body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._respond(with_body=False)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server(request) -> Iterator[FlakyServer]:
    srv = FlakyServer(**getattr(request, "param", {"failures": 0}))
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.mark.parametrize("server", [{"failures": 2}], indirect=True)
def test_transient_http_errors_are_retried(server, tmp_path):
    url = f"http://127.0.0.1:{server.server_address[1]}/names.json"
    copy = fetch_corpus(url, str(tmp_path))
    assert storage.read_bytes(copy.uri, 2**20) == BODY
    assert [s for _, _, s in server.requests].count(503) == 2


def test_missing_url_fails_at_once_naming_the_source(server, tmp_path):
    url = f"http://127.0.0.1:{server.server_address[1]}/missing.json"
    with pytest.raises(FileNotFoundError, match="missing.json"):
        fetch_corpus(url, str(tmp_path))
    assert len(server.requests) <= 2, "a 404 is not retried"
    assert not (tmp_path / "data").exists()


def test_second_fetch_of_the_same_bytes_is_reused(server, tmp_path):
    url = f"http://127.0.0.1:{server.server_address[1]}/names.json"
    first, second = fetch_corpus(url, str(tmp_path)), fetch_corpus(url, str(tmp_path))
    assert not first.reused and second.reused and first.uri == second.uri


def _all_text(error: BaseException, caplog: pytest.LogCaptureFixture) -> str:
    """The error as a traceback prints it (its chain included), plus the log records at INFO
    and above (fsspec's own DEBUG records quote the URL it fetches, off by default)."""
    return "".join(traceback.format_exception(error)) + caplog.text


def test_credentials_of_a_missing_source_appear_in_no_message(server, tmp_path, caplog):
    port = server.server_address[1]
    url = f"http://alice:{PASSWORD}@127.0.0.1:{port}/missing.json?key={KEY}#frag"
    with (
        caplog.at_level(logging.INFO),
        pytest.raises(FileNotFoundError, match=r"source 'http://alice:\*\*\*@") as info,
    ):
        fetch_corpus(url, str(tmp_path))
    assert f"http://alice:***@127.0.0.1:{port}/missing.json?key=***" in str(info.value)
    shown = _all_text(info.value, caplog)
    assert PASSWORD not in shown and KEY not in shown, shown


@pytest.mark.parametrize("server", [{"failures": 99}], indirect=True)
def test_credentials_appear_in_no_retry_warning_nor_final_error(server, tmp_path, caplog):
    url = f"http://alice:{PASSWORD}@127.0.0.1:{server.server_address[1]}/names.json?sig={KEY}"
    with (
        caplog.at_level(logging.INFO),
        pytest.raises(OSError, match=r"could not be read .*503") as info,
    ):
        fetch_corpus(url, str(tmp_path))
    assert [s for _, _, s in server.requests].count(503) >= 2, "transient errors were retried"
    assert "retry 1/" in caplog.text and "alice:***@" in caplog.text
    assert "alice:***@" in str(info.value) and "503" in str(info.value)
    shown = _all_text(info.value, caplog)
    assert PASSWORD not in shown and KEY not in shown, shown


@pytest.mark.parametrize("server", [{"failures": 0, "auth": f"alice:{PASSWORD}"}], indirect=True)
def test_http_credentials_come_from_netrc(server, tmp_path, monkeypatch):
    """The documented place for HTTP credentials: a netrc file ($NETRC or ~/.netrc)."""
    url = f"http://127.0.0.1:{server.server_address[1]}/names.json"
    netrc = tmp_path / "netrc"
    monkeypatch.setenv("NETRC", str(netrc))
    netrc.write_text("machine 127.0.0.1 login alice password wrong\n")
    with pytest.raises(OSError, match="netrc") as info:
        fetch_corpus(url, str(tmp_path / "store"))
    assert "401" in str(info.value) and url in str(info.value)
    netrc.write_text(f"machine 127.0.0.1 login alice password {PASSWORD}\n")
    copy = fetch_corpus(url, str(tmp_path / "store"))
    assert storage.read_bytes(copy.uri, 2**20) == BODY


# docs/configuration.md: a public s3:// source is read anonymously when no key is set.
def test_public_s3_source_is_read_anonymously_without_any_credential(
    s3_endpoint, tmp_path, monkeypatch
):
    """A public object on SeaweedFS (its bucket's policy lets anyone read pets/*), which
    refuses anonymous reads of the others: the read goes out unsigned (no
    NoCredentialsError) and is allowed because the object is public."""
    s3 = s3_client(s3_endpoint)
    s3.put_bucket_policy(Bucket=BUCKET, Policy=json.dumps(PUBLIC_PETS))
    s3.put_object(Bucket=BUCKET, Key="pets/names.json", Body=BODY)
    s3.put_object(Bucket=BUCKET, Key="private/names.json", Body=BODY)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_endpoint)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with without_aws_credentials(monkeypatch):
        copy = fetch_corpus(f"s3://{BUCKET}/pets/names.json", str(tmp_path))
        with pytest.raises(PermissionError, match="Forbidden"):  # anonymous indeed
            fetch_corpus(f"s3://{BUCKET}/private/names.json", str(tmp_path))
    assert storage.read_bytes(copy.uri, 2**20) == BODY and not copy.reused
