"""One promotion at a time per registered model, on every host: a lock kept in the registry.

Every way of promoting (a deployment's retrain, a retrain or sweep started from a shell, on
any machine) talks to the MLflow model registry, and the registry is the one thing they all
share; an artifact-store folder may be S3 (which has no locks) or local to one host. So the
lock lives in the registry, built on the one atomic operation it offers: creating a
registered model. Its database refuses a second model of the same name
(RESOURCE_ALREADY_EXISTS), whether the two creators are threads, processes or hosts.

The lock for model NAME is the registered model `NAME.promotion-lock`: whoever creates it
holds it, deleting it releases it, and the others poll until `wait_s` runs out. Its tags say
who holds it (host, pid, a random token) and until when (`expires_at`, creation + `ttl_s`).

Limits, on purpose to keep this small:
- A holder that dies leaves the lock behind; the next promoter waits until it has expired,
  then deletes it and takes its turn. `ttl_s` must therefore exceed the longest time a live
  holder keeps it (one re-read of the alias, at most one scoring, a few registry writes).
  Two waiters that find the same expired lock at the same moment can both break it.
- Only ddpflow takes this lock: moving the alias by hand (UI, API) does not wait for it.
- The atomicity is the database's: true for MLflow's SQL stores and tracking servers, not for
  the deprecated file store (`./mlruns`).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, RESOURCE_DOES_NOT_EXIST, ErrorCode
from mlflow.tracking import MlflowClient

log = logging.getLogger(__name__)

LOCK_SUFFIX = ".promotion-lock"
TOKEN_TAG = "ddpflow.lock.token"
HOLDER_TAG = "ddpflow.lock.holder"
EXPIRES_TAG = "ddpflow.lock.expires_at"
ALREADY_EXISTS = ErrorCode.Name(RESOURCE_ALREADY_EXISTS)
DOES_NOT_EXIST = ErrorCode.Name(RESOURCE_DOES_NOT_EXIST)


class PromotionLockTimeout(TimeoutError):
    """Another promotion of the same model held the lock for longer than we may wait."""


def lock_name(model_name: str) -> str:
    return f"{model_name}{LOCK_SUFFIX}"


@contextmanager
def promotion_lock(
    client: MlflowClient,
    model_name: str,
    wait_s: float = 1200.0,
    ttl_s: float = 900.0,
    poll_s: float = 0.5,
) -> Iterator[None]:
    """Hold the promotion lock of `model_name` for the body of the `with` block."""
    name = lock_name(model_name)
    token = uuid.uuid4().hex
    deadline = time.monotonic() + wait_s
    while not _try_acquire(client, name, token, ttl_s):
        if time.monotonic() > deadline:
            raise PromotionLockTimeout(
                f"another promotion of registered model {model_name!r} held the lock "
                f"{name!r} for more than {wait_s:.0f}s ({_describe(client, name)}); "
                f"if that process is gone, delete the registered model {name!r} and retry"
            )
        _break_if_expired(client, name)
        time.sleep(poll_s)
    try:
        yield
    finally:
        _release(client, name, token)


def _try_acquire(client: MlflowClient, name: str, token: str, ttl_s: float) -> bool:
    tags = {
        TOKEN_TAG: token,
        HOLDER_TAG: f"{socket.gethostname()}:{os.getpid()}",
        EXPIRES_TAG: f"{time.time() + ttl_s:.3f}",
    }
    try:
        client.create_registered_model(
            name, tags=tags, description="ddpflow promotion lock: one promotion at a time"
        )
    except MlflowException as error:
        if error.error_code == ALREADY_EXISTS:
            return False
        raise
    return True


def _lock_tags(client: MlflowClient, name: str) -> dict[str, str] | None:
    try:
        return dict(client.get_registered_model(name).tags)
    except MlflowException as error:
        if error.error_code == DOES_NOT_EXIST:
            return None  # released between our attempt and this read
        raise


def _break_if_expired(client: MlflowClient, name: str) -> None:
    tags = _lock_tags(client, name)
    if tags is None or float(tags.get(EXPIRES_TAG, "inf")) > time.time():
        return
    _delete_if_held_by(client, name, tags.get(TOKEN_TAG))


def _release(client: MlflowClient, name: str, token: str) -> None:
    # The promotion is done (or failed on its own); a lock we cannot delete now expires.
    try:
        _delete_if_held_by(client, name, token)
    except MlflowException as error:
        log.warning(
            "could not release the promotion lock %r (%s); it expires on its own", name, error
        )


def _delete_if_held_by(client: MlflowClient, name: str, token: str | None) -> None:
    """Delete the lock only if it is still the one we looked at (not a newer holder's)."""
    tags = _lock_tags(client, name)
    if tags is None or tags.get(TOKEN_TAG) != token:
        return
    try:
        client.delete_registered_model(name)
    except MlflowException as error:
        if error.error_code != DOES_NOT_EXIST:
            raise


def _describe(client: MlflowClient, name: str) -> str:
    tags = _lock_tags(client, name) or {}
    return f"holder {tags.get(HOLDER_TAG, '?')}, expires at unix time {tags.get(EXPIRES_TAG, '?')}"
