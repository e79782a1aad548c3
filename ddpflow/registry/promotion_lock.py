"""One promotion at a time per registered model, on every host: a lock kept in the registry.

Every way of promoting (a deployment's retrain, a retrain or sweep started from a shell, on
any machine) talks to the MLflow model registry, and the registry is the one thing they all
share; an artifact-store folder may be S3 or local to one host. So the lock lives in the
registry, built on the one atomic operation it offers: creating a registered model. Its
database refuses a second model of the same name (RESOURCE_ALREADY_EXISTS), whether the two
creators are threads, processes or hosts. Every change of the lock's state is such a
creation, of a name used once, so two actors can never both make the same change:

- The lock of model NAME goes through generations 1, 2, 3, ... Whoever creates the
  registered model `NAME.promotion-lock.<n>` holds generation n.
- Generation n ends when `NAME.promotion-lock.<n>.end` is created: by its holder on release,
  or by a waiter that found the holder dead. Only one of them can create it. A lock is never
  deleted to release it, so no one can delete a newer holder's lock by mistake (the old
  check-then-delete could: a waiter read an expired holder's token, another broke that lock
  and took it, then the first deleted the newcomer's lock and took it too).
- Generation n + 1 may be created only once `<n>.end` exists. A creator then lists the lock's
  models again: if a higher generation exists (it had been asleep while others went on, and
  the name it created had been cleaned up), it holds nothing and waits again.
- The holder of generation n deletes generations up to n - 2 (they can never matter again:
  the state is always read from the highest generation), so the registry keeps a few models
  per promoted model, not one per promotion.

A dead holder is found without comparing two hosts' clocks: the holder rewrites a heartbeat
counter tag on its generation every `ttl_s / 8`; a waiter breaks the lock (creates `.end`)
only after seeing the same generation with the same counter for `ttl_s` on its own monotonic
clock. The counter is compared as a string, never parsed: a missing or garbled tag is just a
value that does not change, so such a lock is broken after `ttl_s` like any dead one, and
names that are not generations (the old `NAME.promotion-lock`, `...lock.x`) are ignored.

Why the holder's write cannot land after a waiter took over: the holder calls
`HeldLock.ensure_held` right before it sets the alias, which fails if `.end` exists or if
less than `max_call_s` is left before `ttl_s` has passed since its last successful
heartbeat *started*. A waiter cannot break before `ttl_s` after that heartbeat was written,
and one MLflow call returns or gives up within `max_call_s` (`ddpflow.registry.call_bound`:
the client's own timeouts and retries), so the alias is set before anyone can take over.
Once two heartbeats land further apart than `ttl_s - max_call_s`, the lock counts as lost
for good, even if later ones land: a waiter may have decided to break it on the older value,
and its `.end` may land after the holder's own check. `ttl_s` must therefore be at least
twice `max_call_s` (checked); a holder starved of time past its lease aborts (safe: nothing
moves) rather than act late.

Limits:
- Only ddpflow takes this lock: moving the alias by hand (UI, API) does not wait for it
  (the promotion re-reads the alias right before setting it and aborts if it moved).
- A request a tracking server applies later than `max_call_s` after it was sent (a server
  stalled mid-request past the client's timeouts) can still land after the lease.
- The atomicity is the database's: true for MLflow's SQL stores and tracking servers, not for
  the deprecated file store (`./mlruns`).
- Deleting every `NAME.promotion-lock.*` model by hand restarts the generations at 1: do it
  only while no promotion of NAME runs. To break a lock at once, create the `.end` model the
  timeout message names.
"""

from __future__ import annotations

import logging
import math
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, RESOURCE_DOES_NOT_EXIST, ErrorCode
from mlflow.tracking import MlflowClient

from ddpflow.registry.call_bound import longest_call_s

log = logging.getLogger(__name__)

LOCK_SUFFIX = ".promotion-lock"
END_SUFFIX = ".end"
HOLDER_TAG = "ddpflow.lock.holder"
BEAT_TAG = "ddpflow.lock.heartbeat"
ENDED_BY_TAG = "ddpflow.lock.ended_by"
ALREADY_EXISTS = ErrorCode.Name(RESOURCE_ALREADY_EXISTS)
DOES_NOT_EXIST = ErrorCode.Name(RESOURCE_DOES_NOT_EXIST)
SEARCH_PAGE = 1000  # the most one registry search returns


class PromotionLockTimeout(TimeoutError):
    """Another promotion of the same model held the lock for longer than we may wait."""


class PromotionLockLost(RuntimeError):
    """The lock was broken, or could be at any moment: the holder must not act any more."""


@dataclass(frozen=True)
class LockTiming:
    """How long a silent holder is trusted, how long to wait, how often to look."""

    ttl_s: float
    max_call_s: float
    wait_s: float
    poll_s: float = 2.0

    def __post_init__(self) -> None:
        for field in ("ttl_s", "max_call_s", "wait_s", "poll_s"):
            value = getattr(self, field)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"promotion lock {field}={value!r}: must be a number > 0")
        if self.ttl_s < 2 * self.max_call_s:
            raise ValueError(
                f"promotion lock ttl_s={self.ttl_s:g} must be at least twice max_call_s="
                f"{self.max_call_s:g} (the longest one MLflow call may take): a holder must "
                "be able to finish its last call before a waiter may break its lock. Raise "
                "ttl_s, or lower MLFLOW_HTTP_REQUEST_TIMEOUT / MLFLOW_HTTP_REQUEST_MAX_RETRIES"
            )

    @property
    def beat_s(self) -> float:
        return self.ttl_s / 8

    @classmethod
    def for_client(cls, client: MlflowClient) -> LockTiming:
        """A lease long enough for the client's slowest call, twice over, plus a minute;
        waiters look every 2 s (each look is one registry search)."""
        max_call_s = longest_call_s(client.tracking_uri)
        ttl_s = 2 * max_call_s + 60
        return cls(ttl_s=ttl_s, max_call_s=max_call_s, wait_s=2 * ttl_s, poll_s=2.0)


def lock_name(model_name: str) -> str:
    """The prefix of every registered model that makes up the lock of `model_name`."""
    return f"{model_name}{LOCK_SUFFIX}"


def generation_name(model_name: str, generation: int) -> str:
    return f"{lock_name(model_name)}.{generation}"


def end_name(model_name: str, generation: int) -> str:
    return f"{generation_name(model_name, generation)}{END_SUFFIX}"


@dataclass(frozen=True)
class LockState:
    """What the registry holds of one model's lock: its highest generation and the rest."""

    generation: int  # 0: never taken
    ended: bool
    beat: str | None  # the heartbeat tag exactly as stored, never parsed
    holder: str
    stale: tuple[str, ...]  # names of generations below generation - 1 and their ends

    @property
    def free(self) -> bool:
        return self.generation == 0 or self.ended


def read_state(client: MlflowClient, model_name: str) -> LockState:
    """The lock's state in one registry search (its models are few: see the cleanup)."""
    pattern = re.compile(rf"{re.escape(lock_name(model_name))}\.([1-9][0-9]*)({END_SUFFIX})?")
    generations: dict[int, dict[str, str]] = {}
    ends: set[int] = set()
    names: dict[str, int] = {}
    for model in _search_prefix(client, lock_name(model_name) + "."):
        match = pattern.fullmatch(model.name)
        if match is None:
            continue  # not one of ours (or hand-made): ignored, never parsed
        number = int(match.group(1))
        names[model.name] = number
        if match.group(2):
            ends.add(number)
        else:
            generations[number] = dict(model.tags or {})
    top = max(generations, default=0)
    tags = generations.get(top, {})
    return LockState(
        generation=top,
        ended=top in ends,
        beat=tags.get(BEAT_TAG),
        holder=tags.get(HOLDER_TAG, "?"),
        stale=tuple(sorted(n for n, number in names.items() if number <= top - 2)),
    )


def _search_prefix(client: MlflowClient, prefix: str) -> Iterator[object]:
    # LIKE treats % and _ as wildcards and the filter parser has no escape for quotes: any
    # such character becomes _ (matches itself too); read_state keeps only exact names.
    safe = "".join(c if c.isalnum() or c in " .-_" else "_" for c in prefix)
    token = None
    while True:
        page = client.search_registered_models(
            filter_string=f"name LIKE '{safe}%'", max_results=SEARCH_PAGE, page_token=token
        )
        yield from page
        token = page.token
        if not token:
            return


class HeldLock:
    """Generation `generation` of a model's lock, held by this process, kept alive by a
    heartbeat thread until `release`."""

    def __init__(
        self,
        client: MlflowClient,
        model_name: str,
        generation: int,
        timing: LockTiming,
        beat_started: float,
    ) -> None:
        self.client = client
        self.model_name = model_name
        self.generation = generation
        self.timing = timing
        self.name = generation_name(model_name, generation)
        self._confirmed = beat_started  # monotonic start of the last beat known written
        self._lapsed = False  # once a gap between beats could let a waiter break: for good
        self._stop = threading.Event()
        # Named after the promoting thread, so a log (or a test) can tell whose beat it is.
        self._thread = threading.Thread(
            target=self._beat,
            name=f"{threading.current_thread().name}-promotion-lock-heartbeat",
            daemon=True,
        )
        self._thread.start()

    def _beat(self) -> None:
        count = 0
        while not self._stop.wait(self.timing.beat_s):
            count += 1
            started = time.monotonic()
            try:
                self.client.set_registered_model_tag(self.name, BEAT_TAG, str(count))
            except MlflowException as error:
                if error.error_code == DOES_NOT_EXIST:
                    return  # cleaned up by a later holder: this lock is long lost
                log.warning("promotion lock %r: heartbeat failed (%s)", self.name, error)
                continue
            except Exception as error:  # noqa: BLE001 - a network error must not end the beat
                log.warning("promotion lock %r: heartbeat failed (%s)", self.name, error)
                continue
            self._confirm_beat(started)

    def _confirm_beat(self, started: float) -> None:
        # A waiter that read the previous beat just before this one landed may have decided
        # to break, and its `.end` may land up to one call later, after our own check of it:
        # so a gap that reached the lease loses the lock for good, whatever comes after.
        if time.monotonic() - self._confirmed + self.timing.max_call_s >= self.timing.ttl_s:
            self._lapsed = True
        self._confirmed = max(self._confirmed, started)

    def ensure_held(self) -> None:
        """Raise PromotionLockLost unless no one can break the lock within one more call."""
        if self._stop.is_set():
            raise PromotionLockLost(f"the promotion lock {self.name!r} was already released")
        if _exists(self.client, end_name(self.model_name, self.generation)):
            raise PromotionLockLost(
                f"the promotion lock {self.name!r} was broken by another promoter (its "
                f"heartbeat stopped for more than {self.timing.ttl_s:g}s)"
            )
        # Measured after the check above returned: that call's time counts against us too.
        silent = time.monotonic() - self._confirmed
        if self._lapsed or silent + self.timing.max_call_s >= self.timing.ttl_s:
            raise PromotionLockLost(
                f"the promotion lock {self.name!r} may be broken before one more registry "
                f"call ends: its heartbeat went {self.timing.ttl_s - self.timing.max_call_s:g}s "
                f"or more without landing (the last started {silent:.1f}s ago), and waiters "
                f"break it after {self.timing.ttl_s:g}s without one"
            )

    def release(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timing.max_call_s)
        ended = _create(
            self.client, end_name(self.model_name, self.generation), {ENDED_BY_TAG: "release"}
        )
        if not ended:
            log.warning("promotion lock %r had already been broken by a waiter", self.name)


def _holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{threading.current_thread().name}"


def _create(client: MlflowClient, name: str, tags: dict[str, str]) -> bool:
    """Create `name`; False if it already exists. The one atomic step of every change."""
    try:
        client.create_registered_model(
            name,
            tags={HOLDER_TAG: _holder(), **tags},
            description="ddpflow promotion lock: one promotion at a time",
        )
    except MlflowException as error:
        if error.error_code == ALREADY_EXISTS:
            return False
        raise
    return True


def _exists(client: MlflowClient, name: str) -> bool:
    try:
        client.get_registered_model(name)
    except MlflowException as error:
        if error.error_code == DOES_NOT_EXIST:
            return False
        raise
    return True


def _clean(client: MlflowClient, names: tuple[str, ...]) -> None:
    """Delete generations that can never matter again; a failure only leaves clutter."""
    for name in names:
        try:
            client.delete_registered_model(name)
        except MlflowException as error:
            if error.error_code != DOES_NOT_EXIST:
                log.warning("promotion lock: could not delete the old %r (%s)", name, error)


def acquire(client: MlflowClient, model_name: str, timing: LockTiming) -> HeldLock:
    """Wait for the lock of `model_name`, breaking it if its holder fell silent."""
    deadline = time.monotonic() + timing.wait_s
    watched: tuple[int, str | None] | None = None  # (generation, heartbeat) seen unchanged
    watched_since = 0.0
    while True:
        state = read_state(client, model_name)
        if state.free:
            number = state.generation + 1
            started = time.monotonic()
            if _create(client, generation_name(model_name, number), {BEAT_TAG: "0"}):
                held = _confirm(client, model_name, number, timing, started)
                if held is not None:
                    return held
            continue  # someone else moved first: read again at once
        seen = (state.generation, state.beat)
        now = time.monotonic()
        if seen != watched:
            watched, watched_since = seen, now
        elif now - watched_since >= timing.ttl_s:
            if _create(client, end_name(model_name, state.generation), {ENDED_BY_TAG: "break"}):
                log.warning(
                    "promotion lock of %r: broke generation %d held by %s (no heartbeat for "
                    "%.1fs)", model_name, state.generation, state.holder, now - watched_since,
                )  # fmt: skip
            continue
        if now > deadline:
            name = generation_name(model_name, state.generation)
            raise PromotionLockTimeout(
                f"another promotion of registered model {model_name!r} held the lock {name!r} "
                f"(holder {state.holder}) for more than {timing.wait_s:.0f}s while its "
                f"heartbeat went on; if that process is gone, the lock is broken "
                f"{timing.ttl_s:.0f}s after its last heartbeat, or at once by creating the "
                f"registered model {end_name(model_name, state.generation)!r}"
            )
        time.sleep(timing.poll_s)


def _confirm(
    client: MlflowClient, model_name: str, number: int, timing: LockTiming, started: float
) -> HeldLock | None:
    """We created generation `number`: it is ours only if no higher one exists (else we had
    slept past a cleanup and re-created a spent name)."""
    try:
        state = read_state(client, model_name)
    except Exception:
        _create(client, end_name(model_name, number), {ENDED_BY_TAG: "release"})  # then raise
        raise
    if state.generation != number or state.ended:
        return None  # the name is below the highest generation: it will be cleaned up
    held = HeldLock(client, model_name, number, timing, started)
    _clean(client, state.stale)
    return held


@contextmanager
def promotion_lock(
    client: MlflowClient, model_name: str, timing: LockTiming | None = None
) -> Iterator[HeldLock]:
    """Hold the promotion lock of `model_name` for the body of the `with` block."""
    held = acquire(client, model_name, timing or LockTiming.for_client(client))
    try:
        yield held
    finally:
        try:
            held.release()
        except Exception as error:  # noqa: BLE001 - the body's own outcome matters more
            log.warning(
                "could not release the promotion lock %r (%s); waiters break it once its "
                "heartbeat has stopped for %gs", held.name, error, held.timing.ttl_s,
            )  # fmt: skip
