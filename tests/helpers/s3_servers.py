"""Fixtures' helpers: S3 servers and an MLflow server, real processes on 127.0.0.1.

The tests' S3 is SeaweedFS; moto is left to the multi-host cluster (infra.netns_cluster) and
benchmarks (docs/testing.md "S3 in the tests")."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import boto3
import pytest
import s3fs

from infra.seaweedfs.config import Identity, S3Key
from infra.seaweedfs.server import start_seaweedfs
from infra.services import Service, free_port, start_mlflow, stop

# The tests' S3 key: SeaweedFS's administrator in the test servers. Distinctive, so a leak is
# found.
ACCESS_KEY = "AKIADDPFLOWTESTKEY42"
SECRET_KEY = "ddpflow-test-secret-value-must-never-leak-7f3a"
TEST_ADMIN = Identity("ddpflow-test", S3Key(ACCESS_KEY, SECRET_KEY))


def s3_env(endpoint: str) -> dict[str, str]:
    return {
        "AWS_ENDPOINT_URL_S3": endpoint,
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": "us-east-1",
    }


def use_s3(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> None:
    """This test process talks to `endpoint` with the test keys (s3_env)."""
    for key, value in s3_env(endpoint).items():
        monkeypatch.setenv(key, value)


# No AWS credential anywhere botocore looks: keys, profile, files, instance metadata.
NO_AWS_CREDENTIALS = {
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials",
    "AWS_CONFIG_FILE": "/nonexistent/aws-config",
    "AWS_EC2_METADATA_DISABLED": "true",  # no 1-2 s wait for an instance role
}
AWS_KEY_VARIABLES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
)


@contextmanager
def with_aws_keys(
    monkeypatch: pytest.MonkeyPatch, access_key_id: str, secret_access_key: str
) -> Iterator[None]:
    """This process uses these keys while the block runs (e.g. a wrong one). s3fs's cached
    filesystems are dropped before and after, as in without_aws_credentials."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret_access_key)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        yield
    finally:
        s3fs.S3FileSystem.clear_instance_cache()


@contextmanager
def without_aws_credentials(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process has no AWS credential while the block runs.

    s3fs's cached filesystems are dropped before and after: fsspec hands back a filesystem
    made with the same options, whatever credentials it was made with.
    """
    for key in AWS_KEY_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    for key, value in NO_AWS_CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        yield
    finally:
        s3fs.S3FileSystem.clear_instance_cache()


def s3_client(
    endpoint: str, key_id: str = ACCESS_KEY, secret: str = SECRET_KEY, service: str = "s3"
):
    """A boto3 client of the endpoint (the tests' key unless given another)."""
    return boto3.client(
        service,
        endpoint_url=endpoint,
        aws_access_key_id=key_id,
        aws_secret_access_key=secret,
        region_name="us-east-1",
    )


def list_keys(
    endpoint: str,
    bucket: str,
    prefix: str = "",
    key_id: str = ACCESS_KEY,
    secret: str = SECRET_KEY,
) -> list[str]:
    paginator = s3_client(endpoint, key_id, secret).get_paginator("list_objects_v2")
    return [
        obj["Key"]
        for page in paginator.paginate(Bucket=bucket, Prefix=prefix)
        for obj in page.get("Contents", [])
    ]


def start_test_seaweedfs(folder: Path, buckets: tuple[str, ...] = ()) -> Service:
    """A SeaweedFS server whose administrator is the tests' key (s3_env), with buckets; its
    data, configuration and log in folder. Stop it with `stop`.

    `stop` kills it at once (after its SIGTERM): a test server's data goes with its folder,
    and SeaweedFS 4.48's master outlives SIGTERM anyway, so the 3 s wait before SIGKILL that
    infra.seaweedfs.server gives the stack's server would only add 3 s to every stop."""
    service = start_seaweedfs(
        free_port(), folder / "data", folder / "config", folder, [TEST_ADMIN], buckets
    )
    service.stop_wait_s = 0.0
    return service


@contextmanager
def seaweedfs_server(folder: Path, buckets: tuple[str, ...] = ()) -> Iterator[str]:
    """A SeaweedFS S3 endpoint (start_test_seaweedfs) for the block; yields its URL."""
    service = start_test_seaweedfs(folder, buckets)
    try:
        yield service.url
    finally:
        stop(service)


@contextmanager
def mlflow_server(log_dir: Path, endpoint: str, destination: str) -> Iterator[Service]:
    service = start_mlflow(
        free_port(),
        f"sqlite:///{log_dir / 'mlflow-server.db'}",
        destination,
        env=s3_env(endpoint),
        log_dir=log_dir,
    )
    try:
        yield service
    finally:
        stop(service)
