"""The promotion lock as it was before generations, kept only to show the race it had.

It took the lock by creating the registered model `NAME.promotion-lock` (atomic), but broke
an expired lock by check-then-delete: read the holder's token, then delete the model by
name. Between the read and the delete another waiter could break the same lock and take it,
and the delete then removed the newcomer's lock. Expiry compared the holder's wall clock
(`expires_at`) with the waiter's. Never used by ddpflow; tests drive it to reproduce the race.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

TOKEN_TAG = "ddpflow.lock.token"
EXPIRES_TAG = "ddpflow.lock.expires_at"


@contextmanager
def legacy_promotion_lock(
    client: MlflowClient, model_name: str, ttl_s: float, poll_s: float = 0.02
) -> Iterator[None]:
    name = f"{model_name}.promotion-lock"
    token = uuid.uuid4().hex
    while not _try_acquire(client, name, token, ttl_s):
        _break_if_expired(client, name)
        time.sleep(poll_s)
    try:
        yield
    finally:
        _delete_if_held_by(client, name, token)


def _try_acquire(client: MlflowClient, name: str, token: str, ttl_s: float) -> bool:
    tags = {TOKEN_TAG: token, EXPIRES_TAG: f"{time.time() + ttl_s:.3f}"}
    try:
        client.create_registered_model(name, tags=tags)
    except MlflowException as error:
        if error.error_code == "RESOURCE_ALREADY_EXISTS":
            return False
        raise
    return True


def _lock_tags(client: MlflowClient, name: str) -> dict[str, str] | None:
    try:
        return dict(client.get_registered_model(name).tags)
    except MlflowException as error:
        if error.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise


def _break_if_expired(client: MlflowClient, name: str) -> None:
    tags = _lock_tags(client, name)
    if tags is None or float(tags.get(EXPIRES_TAG, "inf")) > time.time():
        return
    _delete_if_held_by(client, name, tags.get(TOKEN_TAG))


def _delete_if_held_by(client: MlflowClient, name: str, token: str | None) -> None:
    tags = _lock_tags(client, name)
    if tags is None or tags.get(TOKEN_TAG) != token:
        return
    try:  # the check above and this delete are two calls: the race is between them
        client.delete_registered_model(name)
    except MlflowException as error:
        if error.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
