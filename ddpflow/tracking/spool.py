"""Rank 0's logging calls wait on disk until MLflow takes them (an outage loses nothing).

Every call is written to a folder before it is sent and deleted once MLflow took it, so a
server that is down only delays it. The folder is bounded: a call that does not fit is not
kept, and says so in the log and in the list of what MLflow is missing.

Layout of the folder:
    00000007.json       one call: {"seq", "kind", "what", "body"}, written atomically
    00000007/NAME       the file of an artifact call (a copy: the caller may delete its own)
    not-kept.jsonl      one line per call refused because the folder was full
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SPOOL_MB_ENV = "DDPFLOW_TRACKING_SPOOL_MB"
FLUSH_TIMEOUT_ENV = "DDPFLOW_TRACKING_FLUSH_TIMEOUT_S"
DEFAULT_SPOOL_MB = 2048.0
DEFAULT_FLUSH_TIMEOUT_S = 300.0
NOT_KEPT_NAME = "not-kept.jsonl"


@dataclass(frozen=True)
class Unsent:
    """One logging call MLflow does not have. `path`: where it waits on disk (None: it was
    not kept, the folder was full); `origin`: where the original of an artifact lives."""

    what: str
    path: str | None = None
    origin: str | None = None
    not_kept_because: str = "the spool was full"

    def line(self) -> str:
        where = f"waits in {self.path}" if self.path else f"NOT KEPT ({self.not_kept_because})"
        return f"{self.what}: {where}" + (f"; original at {self.origin}" if self.origin else "")


@dataclass(frozen=True)
class Entry:
    seq: int
    kind: str  # "metrics", "artifact", "keep" (prune artifacts) or "tags"
    what: str
    body: dict[str, Any]
    file: str | None  # an artifact's copy in the folder
    origin: str | None
    size: int


class Spool:
    """An ordered, bounded on-disk queue of logging calls; safe across two threads."""

    def __init__(self, folder: Path, max_bytes: int):
        if max_bytes <= 0:
            raise ValueError(f"a tracking spool needs max_bytes > 0, got {max_bytes}")
        self.folder = folder
        self.max_bytes = max_bytes
        folder.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._pending: list[Entry] = []
        self._not_kept: list[Unsent] = []
        self._bytes = 0
        self._seq = 0
        self._warned_full = False

    def add(
        self,
        kind: str,
        what: str,
        body: dict[str, Any],
        file: str | None = None,
        origin: str | None = None,
    ) -> bool:
        """Keep one call (and a copy of `file`); False if the folder has no room for it."""
        record = json.dumps({"kind": kind, "what": what, "body": body, "origin": origin})
        size = len(record) + (os.path.getsize(file) if file else 0)
        with self._lock:
            self._seq += 1
            seq = self._seq
            if self._bytes + size > self.max_bytes:
                self._refuse(Unsent(what, None, origin), size)
                return False
            self._bytes += size
        copy = None
        try:
            if file is not None:
                copy = str(self.folder / f"{seq:08d}" / os.path.basename(file))
                os.makedirs(os.path.dirname(copy))
                shutil.copyfile(file, copy)
            _write_atomically(self.folder / f"{seq:08d}.json", record)
        except OSError as error:  # e.g. a full disk: never stop training, list it as missing
            with self._lock:
                self._bytes -= size
                self._not_kept.append(Unsent(what, None, origin, f"the disk failed: {error}"))
            log.error("tracking spool cannot keep %s, it will be missing: %s", what, error)
            return False
        with self._lock:
            self._pending.append(Entry(seq, kind, what, body, copy, origin, size))
        return True

    def last_seq(self) -> int:
        """The number of the newest call added so far (0: none)."""
        with self._lock:
            return self._seq

    def oldest(self) -> Entry | None:
        with self._lock:
            return self._pending[0] if self._pending else None

    def remove(self, entry: Entry) -> None:
        """MLflow took `entry`: forget it and free its room."""
        with self._lock:
            if entry not in self._pending:
                return
            self._pending.remove(entry)
            self._bytes -= entry.size
        (self.folder / f"{entry.seq:08d}.json").unlink(missing_ok=True)
        if entry.file is not None:
            shutil.rmtree(os.path.dirname(entry.file), ignore_errors=True)

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)

    def unsent(self) -> list[Unsent]:
        """What MLflow does not have: the calls not kept, then those waiting, in order."""
        with self._lock:
            waiting = [
                Unsent(e.what, e.file or str(self.folder / f"{e.seq:08d}.json"), e.origin)
                for e in self._pending
            ]
            return [*self._not_kept, *waiting]

    def remove_folder_if_empty(self) -> None:
        """Nothing waits and nothing was refused: the folder has no more use."""
        with self._lock:
            empty = not self._pending and not self._not_kept
        if empty:
            shutil.rmtree(self.folder, ignore_errors=True)

    def _refuse(self, unsent: Unsent, size: int) -> None:
        # Called with the lock held. Training goes on; the call is listed as missing.
        self._not_kept.append(unsent)
        try:
            with open(self.folder / NOT_KEPT_NAME, "a") as f:
                f.write(json.dumps({"what": unsent.what, "origin": unsent.origin}) + "\n")
        except OSError as error:  # the list returned by unsent() still has it
            log.error("cannot write %s: %s", NOT_KEPT_NAME, error)
        if not self._warned_full:
            self._warned_full = True
            log.error(
                "tracking spool %s is full (%d of %d bytes, set by %s): %s (%d bytes) and "
                "every further call that does not fit are NOT kept and will be missing from "
                "MLflow; training goes on",
                self.folder, self._bytes, self.max_bytes, SPOOL_MB_ENV, unsent.what, size,
            )  # fmt: skip
        else:
            log.error("tracking spool full: %s is NOT kept", unsent.what)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _positive_env(name: str, default: float, unit: str) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(
            f"{name}={raw!r} is not a positive number of {unit}; set e.g. {name}={default:g} "
            f"or unset it for the default ({default:g} {unit})"
        )
    return value


def spool_max_bytes() -> int:
    """The spool's bound from DDPFLOW_TRACKING_SPOOL_MB (megabytes, default 2048)."""
    return int(_positive_env(SPOOL_MB_ENV, DEFAULT_SPOOL_MB, "megabytes") * 1024 * 1024)


def flush_timeout_s() -> float:
    """How long the end of training waits for MLflow to take what waits on disk."""
    return _positive_env(FLUSH_TIMEOUT_ENV, DEFAULT_FLUSH_TIMEOUT_S, "seconds")


def unsent_markdown(run_id: str, unsent: list[Unsent] | tuple[Unsent, ...]) -> str:
    """The Prefect artifact's text: each missing call and where its original is."""
    rows = "\n".join(
        f"| {i} | {u.what.replace('|', '/')} | {u.path or 'not kept: ' + u.not_kept_because} "
        f"| {u.origin or '-'} |"
        for i, u in enumerate(unsent, 1)
    )
    return (
        f"# MLflow run `{run_id}` is missing {len(unsent)} logging calls\n\n"
        "MLflow could not be reached before the end-of-training wait ran out "
        f"({FLUSH_TIMEOUT_ENV}), or the tracking spool was full ({SPOOL_MB_ENV}). "
        "These calls are not in the run:\n\n"
        "| # | call | waits on disk at | original |\n|---|---|---|---|\n"
        f"{rows}\n"
    )
