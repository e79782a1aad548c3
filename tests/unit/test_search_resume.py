"""A search's study in its journal file: reopened by name after its flow process died, it
keeps the finished trials, asks the interrupted ones again and counts the budget on."""

from __future__ import annotations

from pathlib import Path

import pytest
from optuna.trial import TrialState

from ddpflow.workloads.sweep.space import parse_space
from flows.search.resume import INTERRUPTED_ATTR, REASKED_ATTR, take_over
from flows.search.storage import StudyStorageError, journal_path, study_storage
from flows.search.study import StudyDesk, make_study

SPACE = {"lr": {"low": 1e-4, "high": 1e-1, "log": True}, "hidden_size": {"choices": [16, 32]}}


def open_desk(root: Path, name: str = "s1", seed: int = 0) -> StudyDesk:
    storage = study_storage(str(root), name, named=True)
    study = make_study("tpe", "asha", seed, 1, 2, 4, study_name=name, storage=storage)
    return StudyDesk(study, parse_space(SPACE))


def test_the_journal_is_a_file_in_the_artifact_root(tmp_path: Path) -> None:
    assert journal_path(str(tmp_path), "s1") == tmp_path / "studies" / "s1.journal"
    open_desk(tmp_path).ask()
    assert (tmp_path / "studies" / "s1.journal").stat().st_size > 0


def test_a_named_study_needs_a_local_artifact_root() -> None:
    with pytest.raises(StudyStorageError, match="must be a local folder"):
        study_storage("s3://bucket/prefix", "s1", named=True)
    assert study_storage("s3://bucket/prefix", "s1", named=False) is None  # in memory


def test_a_reopened_study_keeps_finished_trials_and_asks_interrupted_ones_again(
    tmp_path: Path,
) -> None:
    first = open_desk(tmp_path)
    done, _ = first.ask()
    first.tell(done, TrialState.COMPLETE, 1.5)
    running = [first.ask() for _ in range(2)]  # the process dies while these train

    again = open_desk(tmp_path)  # the rerun, as a new process opens the file
    resumed = take_over(again.study)
    assert [t.number for t in resumed.kept] == [done.number]
    assert [t.number for t in resumed.interrupted] == [t.number for t, _ in running]
    assert resumed.done == 1
    assert again.study.user_attrs[INTERRUPTED_ATTR] == [t.number for t, _ in running]
    reasked = [again.ask() for _ in range(2)]
    assert [v for _, v in reasked] == [v for _, v in running], "same values, asked again"
    assert [t.user_attrs[REASKED_ATTR] for t, _ in reasked] == [t.number for t, _ in running]
    fresh, values = again.ask()
    assert values not in [v for _, v in running] and fresh.number == 5

    for trial, _ in reasked:
        again.tell(trial, TrialState.PRUNED)
    again.tell(fresh, TrialState.COMPLETE, 1.2)
    third = take_over(open_desk(tmp_path).study)  # nothing ran: nothing interrupted now
    assert third.interrupted == [] and third.done == 4
    assert again.best() == (fresh.number, 1.2, values)
