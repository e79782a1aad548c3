"""One promotion at a time per registered model: a Prefect global concurrency limit.

Promoting model NAME holds the one slot of the limit `ddpflow-promote-NAME` (made with limit 1
by the first promotion) on the Prefect server in PREFECT_API_URL, under a lease of LEASE_S
(the shortest Prefect grants) that a thread renews every LEASE_S / 4 while the holder lives.
A dead holder's lease is revoked by the server's repossessor once expired (it looks every
PREFECT_SERVER_SERVICES_REPOSSESSOR_LOOP_SECONDS, 15 s by default); the next promotion takes
the slot at its next try. Prefect's `concurrency()` makes the same calls but hides the lease,
so its holder could not check it before writing: `ensure_held` renews it right before the
alias write, and fails if that renewal fails (revoked) or if the lease may have lapsed since
the last renewal that landed (Prefect renews an expired lease not yet revoked, while the
repossessor may be handing its slot to another). A holder frozen past its lease (SIGSTOP, a
paused VM) or cut off from the server aborts; the write gets a fresh lease to land in.

A flow's command line without PREFECT_API_URL runs on an API of its own (early_api): no
server other promoters share, and in ephemeral mode, which never revokes a lease. Without a
shared server, a registry in a local file (sqlite, a path) counts as one user's and promotes
unlocked; a shared one (a tracking or database server) refuses, naming PREFECT_API_URL.
Prefect's own temporary server (a flow called from Python without it) is not told apart.

Limits: it orders ddpflow's promotions, it is no access control; an alias write that lands a
lease after its last check (stalled in MLflow's retries) can land after the next holder's.
"""

from __future__ import annotations

import contextvars
import logging
import os
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from urllib.parse import urlparse
from uuid import UUID

import httpx
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
from prefect.settings import PREFECT_API_URL

from ddpflow.integrations.prefect.early_api import EMBEDDED_API_ENV
from ddpflow.registry.promotion_lock import NOT_LOCKED, HeldLock, PromotionLockLost
from ddpflow.storage.redact import redact_url

log = logging.getLogger(__name__)

LEASE_S = 60.0  # Prefect's API refuses a shorter lease_duration
WAIT_S = 600.0  # a live promotion holds the slot for seconds; a dead one about a lease
POLL_S = 2.0


class PromotionLockUnavailable(RuntimeError):
    """No Prefect server can serialise this promotion with the others."""


def limit_name(model_name: str) -> str:
    """The limit's name; characters Prefect refuses in names or URL paths become `_` (two
    models sharing a limit only wait for each other)."""
    return "ddpflow-promote-" + re.sub(r"[^A-Za-z0-9._-]", "_", model_name)


def shared_api_url() -> str | None:
    """PREFECT_API_URL, unless unset or the flow's own embedded API (in its workers too)."""
    url = PREFECT_API_URL.value()
    return None if not url or url == os.environ.get(EMBEDDED_API_ENV) else url


def _local_registry(tracking_uri: str) -> bool:
    """A registry in a file of this host (sqlite, a folder), not a server's."""
    scheme = urlparse(tracking_uri).scheme
    return scheme in ("file", "sqlite") or not (scheme or tracking_uri.startswith("databricks"))


class Lease:
    """The slot of limit `name`, held by this process under lease `lease_id`."""

    def __init__(self, client: SyncPrefectClient, name: str, lease_id: UUID, since: float):
        self.name, self.lease_id, self._client = name, lease_id, client
        self._confirmed = since  # monotonic start of the last request that set the lease
        self._lapsed = False
        self._guard = threading.Lock()
        self._stop = threading.Event()
        # The thread's client must find the same API as this one (a settings context).
        context = contextvars.copy_context()
        self._thread = threading.Thread(
            target=context.run, args=(self._keep,), name=f"{name}-lease", daemon=True
        )
        self._thread.start()

    def _keep(self) -> None:
        with get_client(sync_client=True) as client:
            while not self._stop.wait(LEASE_S / 4):
                self._renew(client)

    def _renew(self, client: SyncPrefectClient) -> bool:
        started = time.monotonic()
        try:
            client.renew_concurrency_lease(self.lease_id, LEASE_S)
        except Exception as error:  # noqa: BLE001 - a failed renewal only shortens the lease
            log.warning("promotion limit %r: renewing its lease failed (%s)", self.name, error)
            return False
        with self._guard:
            # Landed a lease or more after the last one: the slot may have been revoked and
            # given to another meanwhile, whatever this renewal says.
            self._lapsed |= time.monotonic() - self._confirmed >= LEASE_S
            self._confirmed = max(self._confirmed, started)
        return True

    def ensure_held(self) -> None:
        if not self._renew(self._client) or self._lapsed:
            raise PromotionLockLost(
                f"the promotion limit {self.name!r} may be another promotion's now: its "
                f"lease could not be renewed, or went {LEASE_S:g}s or more without a renewal"
            )

    def release(self) -> None:
        self._stop.set()
        self._thread.join(LEASE_S / 4)
        # A lease the server revoked is not found, and releasing it frees no one's slot.
        self._client.release_concurrency_slots_with_lease(self.lease_id)


def _ensure_limit(client: SyncPrefectClient, name: str) -> None:
    try:
        limit = client.read_global_concurrency_limit_by_name(name)
    except ObjectNotFound:
        with suppress(ObjectAlreadyExists):  # another promotion created it meanwhile
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
        return
    if limit.limit != 1 or not limit.active:
        raise PromotionLockUnavailable(
            f"Prefect's concurrency limit {name!r} must be active with limit 1 to serialise "
            f"promotions (it has limit {limit.limit}, active {limit.active}); set it back, "
            f"e.g. `prefect gcl update {name} --limit 1 --enable`"
        )


def _acquire(client: SyncPrefectClient, name: str, wait_s: float, poll_s: float) -> Lease:
    deadline = time.monotonic() + wait_s
    while True:
        started = time.monotonic()
        try:
            answer = client.increment_concurrency_slots_with_lease(
                names=[name], slots=1, mode="concurrency", lease_duration=LEASE_S
            ).json()
        except httpx.HTTPStatusError as error:
            if error.response.status_code != 423:  # 423: the slot is held
                raise
            if started + poll_s > deadline:
                raise TimeoutError(
                    f"another promotion held Prefect's concurrency limit {name!r} for more "
                    f"than {wait_s:g}s; a holder that died frees it about {LEASE_S:g}s after "
                    f"its last renewal, at once with `prefect gcl update {name} "
                    "--active-slots 0`"
                ) from None
            time.sleep(poll_s)
            continue
        if not answer["limits"]:  # deleted since _ensure_limit: nothing was taken
            raise PromotionLockUnavailable(f"Prefect's concurrency limit {name!r} is gone")
        return Lease(client, name, UUID(answer["lease_id"]), started)


@contextmanager
def promotion_lock(
    tracking_uri: str, model_name: str, wait_s: float = WAIT_S, poll_s: float = POLL_S
) -> Iterator[HeldLock]:
    """Hold `model_name`'s promotion limit for the block (a `PromotionLock`)."""
    if shared_api_url() is None:
        if not _local_registry(tracking_uri):
            raise PromotionLockUnavailable(
                f"promoting {model_name!r} in the shared registry {redact_url(tracking_uri)} "
                "needs the Prefect server every promoter uses, where its concurrency limit "
                "lives: set PREFECT_API_URL to it (e.g. `prefect server start`, then "
                "PREFECT_API_URL=http://<host>:4200/api). A flow's own API, started when "
                "PREFECT_API_URL is unset, serialises nothing beyond that flow. Nothing moved"
            )
        log.info("promoting %r without a lock: no shared Prefect server", model_name)
        yield NOT_LOCKED
        return
    name = limit_name(model_name)
    with get_client(sync_client=True) as client:
        _ensure_limit(client, name)
        lease = _acquire(client, name, wait_s, poll_s)
        try:
            yield lease
        finally:
            try:
                lease.release()
            except Exception as error:  # noqa: BLE001 - the block's own outcome matters more
                log.warning("promotion limit %r: release failed (%s)", name, error)
