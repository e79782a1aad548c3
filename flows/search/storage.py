"""Where a search's Optuna study lives: a journal file in the artifact root, so the study
survives its flow process and a rerun with the same `study_name` resumes it.

`<artifact root>/studies/<study name>.journal` (Optuna's JournalStorage over a
JournalFileBackend: an append-only log of the study's operations, safe for several processes
on one machine through its lock file). A journal needs a local file: with an `s3://`
artifact root a named study is refused before any trial starts, and an unnamed one stays in
the flow's memory (not resumable).
"""

from __future__ import annotations

from pathlib import Path

import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend

from ddpflow.storage import url_to_fs

STUDIES_DIR = "studies"


class StudyStorageError(ValueError):
    """A named study cannot be stored where the artifact root is."""


def journal_path(artifact_root: str, study_name: str) -> Path | None:
    """The study's journal file, or None where the artifact root is not a local folder."""
    fs, path = url_to_fs(artifact_root)
    if "file" not in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        return None
    return Path(path) / STUDIES_DIR / f"{study_name}.journal"


def study_storage(
    artifact_root: str, study_name: str, named: bool
) -> optuna.storages.BaseStorage | None:
    """The journal storage of `study_name`; None (in memory) for an unnamed study where no
    local file can hold it. A named (resumable) study there raises StudyStorageError."""
    path = journal_path(artifact_root, study_name)
    if path is None:
        if named:
            raise StudyStorageError(
                f"study_name={study_name!r}: a resumable study is a journal file in the artifact "
                f"root, which must be a local folder (DDPFLOW_ARTIFACT_ROOT is {artifact_root}); "
                "leave study_name unset to search without resume"
            )
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(str(path)))
