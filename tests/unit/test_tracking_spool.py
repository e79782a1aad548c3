"""The tracking spool: rank 0's logging calls wait on disk, bounded, oldest first.

A dead MLflow here is a 127.0.0.1 port where nothing listens (real HTTP, refused at once);
the logging thread tries each call once (ddpflow.tracking.one_try), so the tests take
seconds, not MLflow's default minutes of retries. An MLflow that is back is a SQLite store.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from ddpflow.checkpoint.store import record_checkpoint
from ddpflow.tracking.loggers import BackgroundMlflowLogger, RunRef, spool_folder
from ddpflow.tracking.run import TRACKING_INCOMPLETE_TAG, end_run, start_run
from ddpflow.tracking.spool import (
    NOT_KEPT_NAME,
    Spool,
    flush_timeout_s,
    spool_max_bytes,
    unsent_markdown,
)


@pytest.fixture
def dead_mlflow() -> RunRef:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return RunRef(f"http://127.0.0.1:{sock.getsockname()[1]}", "0" * 32)


def test_the_spool_gives_calls_back_oldest_first_and_forgets_what_was_sent(tmp_path):
    spool = Spool(tmp_path / "spool", max_bytes=10_000)
    for step in (1, 2, 3):
        assert spool.add("metrics", f"metrics loss at step {step}", {"step": step})
    first = spool.oldest()
    assert first is not None and first.body == {"step": 1}
    spool.remove(first)
    spool.remove(first)  # a second remove (a late answer) changes nothing
    assert [u.what for u in spool.unsent()] == ["metrics loss at step 2", "metrics loss at step 3"]
    assert sorted(p.name for p in (tmp_path / "spool").iterdir()) == [
        "00000002.json",
        "00000003.json",
    ]


def test_a_full_spool_refuses_a_call_says_so_and_lists_it_as_not_kept(tmp_path, caplog):
    spool = Spool(tmp_path / "spool", max_bytes=2_000)
    checkpoint = tmp_path / "epoch-0001.pt"
    checkpoint.write_bytes(b"x" * 5_000)
    assert spool.add("metrics", "metrics loss at step 1", {"step": 1})
    with caplog.at_level(logging.ERROR, logger="ddpflow.tracking.spool"):
        kept = spool.add(
            "artifact", "artifact checkpoints/epoch-0001.pt", {}, str(checkpoint), "/ckpt/e1.pt"
        )
    assert not kept
    assert "is full" in caplog.text and "NOT kept" in caplog.text
    assert "DDPFLOW_TRACKING_SPOOL_MB" in caplog.text
    assert spool.add("metrics", "metrics loss at step 2", {"step": 2}), "small calls still fit"
    unsent = spool.unsent()
    assert [(u.what, u.path, u.origin) for u in unsent[:1]] == [
        ("artifact checkpoints/epoch-0001.pt", None, "/ckpt/e1.pt")
    ]
    assert [u.what for u in unsent[1:]] == ["metrics loss at step 1", "metrics loss at step 2"]
    assert "NOT KEPT" in unsent[0].line() and "/ckpt/e1.pt" in unsent[0].line()
    not_kept = (tmp_path / "spool" / NOT_KEPT_NAME).read_text().splitlines()
    assert [json.loads(line)["what"] for line in not_kept] == ["artifact checkpoints/epoch-0001.pt"]


def test_a_dead_server_loses_nothing_every_call_waits_on_disk_in_order(tmp_path, dead_mlflow):
    logger = BackgroundMlflowLogger(dead_mlflow, tmp_path / "spool", close_timeout_s=1.0)
    started = time.monotonic()
    for step in range(1, 51):
        logger.log_metrics({"train_loss": 1.0 / step}, step=step)
    checkpoint = tmp_path / "epoch-0001.pt"
    checkpoint.write_bytes(b"checkpoint bytes")
    record_checkpoint(logger, "/ckpt/epoch-0001.pt", b"checkpoint bytes")
    assert time.monotonic() - started < 2, "logging only writes to disk"
    beats: list[float] = []
    unsent = logger.close(heartbeat=lambda: beats.append(time.monotonic()))
    assert beats, "waiting at the end keeps the rank's heartbeat going"
    assert [u.what for u in unsent] == [
        *(f"metrics train_loss at step {step}" for step in range(1, 51)),
        "artifact checkpoints/epoch-0001.pt",
        "tags ddpflow.latest_checkpoint=/ckpt/epoch-0001.pt",
    ]
    assert all(u.path and os.path.exists(u.path) for u in unsent), "each waits on disk"
    assert Path(unsent[50].path).read_bytes() == b"checkpoint bytes"
    assert unsent[50].origin == "/ckpt/epoch-0001.pt"


def test_calls_kept_during_an_outage_reach_mlflow_once_with_their_step_and_time(tmp_path):
    """The outage: MLflow refuses the first calls (a store that is not there yet: its
    file is created only after some calls failed). Once it answers, every call goes in, in
    order, each step once and stamped with the time it was logged, not sent."""
    store = tmp_path / "later"
    tracking_uri = f"sqlite:///{store / 'mlflow.db'}"
    os.makedirs(store)
    run = start_run(tracking_uri, "spool", "spool", {}, {})
    moved = store.with_name("away")
    os.rename(store, moved)  # MLflow is "down": its store cannot be opened
    logger = BackgroundMlflowLogger(run, tmp_path / "spool", close_timeout_s=60, retry_max_s=0.2)
    stamps = []
    for step in range(1, 6):
        stamps.append(int(time.time() * 1000))
        logger.log_metrics({"train_loss": float(step)}, step=step)
        time.sleep(0.01)
    time.sleep(1.0)  # a few failed tries
    assert len(logger.spool) == 5
    os.rename(moved, store)  # back
    assert logger.close() == []
    history = MlflowClient(tracking_uri).get_metric_history(run.run_id, "train_loss")
    assert sorted((m.step, m.value) for m in history) == [(s, float(s)) for s in range(1, 6)]
    for metric in history:
        assert 0 <= metric.timestamp - stamps[metric.step - 1] < 50
    assert not (tmp_path / "spool").exists(), "an empty spool leaves no folder behind"


def test_a_full_spool_never_stops_training_and_the_run_says_what_it_lacks(tmp_path):
    run = start_run(f"sqlite:///{tmp_path / 'mlflow.db'}", "spool", "spool", {}, {})
    logger = BackgroundMlflowLogger(run, tmp_path / "spool", max_spool_bytes=1_000)
    logger.log_metrics({"train_loss": 1.0}, step=1)
    record_checkpoint(logger, "/ckpt/epoch-0001.pt", b"x" * 4_000)  # too big for the spool
    logger.log_metrics({"train_loss": 0.5}, step=2)
    unsent = logger.close()
    assert [(u.what, u.path, u.origin) for u in unsent] == [
        ("artifact checkpoints/epoch-0001.pt", None, "/ckpt/epoch-0001.pt")
    ]
    client = MlflowClient(run.tracking_uri)
    assert [m.step for m in client.get_metric_history(run.run_id, "train_loss")] == [1, 2]
    assert client.list_artifacts(run.run_id, "checkpoints") == []
    end_run(run, unsent=unsent)
    finished = client.get_run(run.run_id)
    assert finished.info.status == "FINISHED"
    assert finished.data.tags[TRACKING_INCOMPLETE_TAG] == (
        "1 logging calls are not in this run (1 not kept: the spool was full)"
    )
    markdown = unsent_markdown(run.run_id, unsent)
    assert "artifact checkpoints/epoch-0001.pt" in markdown and "/ckpt/epoch-0001.pt" in markdown


def test_the_spool_lives_beside_a_local_runs_checkpoints(tmp_path):
    folder = spool_folder(str(tmp_path / "runs" / "abc" / "checkpoints"), "abc")
    assert folder.parent == tmp_path / "runs" / "abc" / "tracking-spool"
    remote = spool_folder("s3://bucket/runs/abc/checkpoints", "abc")
    assert "abc" in remote.parts and not str(remote).startswith("s3:")


@pytest.mark.parametrize(
    ("name", "read"),
    [
        ("DDPFLOW_TRACKING_SPOOL_MB", spool_max_bytes),
        ("DDPFLOW_TRACKING_FLUSH_TIMEOUT_S", flush_timeout_s),
    ],
)
def test_a_bad_bound_names_the_variable_and_the_fix(monkeypatch, name, read):
    monkeypatch.setenv(name, "lots")
    with pytest.raises(ValueError, match=rf"{name}='lots' is not a positive number.*unset it"):
        read()
    monkeypatch.setenv(name, "0.5")
    assert read() > 0


def test_a_spool_folder_that_cannot_be_made_falls_back_to_a_temporary_one(tmp_path, caplog):
    """A run folder where `runs` is a file (the store refuses it): logging still works; the
    checkpoint write is what reports the store."""
    from ddpflow.tracking.loggers import _open_spool

    (tmp_path / "runs").write_text("not a folder")
    wanted = tmp_path / "runs" / "abc" / "tracking-spool" / "1"
    spool = _open_spool(wanted, 1024)
    assert spool.folder != wanted and spool.folder.is_dir()
    assert "cannot keep logging calls in" in caplog.text


def test_mlflow_keeps_the_checkpoints_the_store_keeps_and_a_refused_delete_blocks_nothing(
    tmp_path, monkeypatch, caplog
):
    tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    location = (tmp_path / "mlartifacts").as_uri()
    run = start_run(tracking_uri, "spool", "keep", {}, {}, artifact_location=location)
    logger = BackgroundMlflowLogger(run, tmp_path / "spool", close_timeout_s=30)
    names = [f"epoch-{epoch:04d}.pt" for epoch in range(1, 5)]
    for epoch, name in enumerate(names, start=1):  # keep_last=2, as the store prunes
        record_checkpoint(
            logger, f"/ckpt/{name}", b"x" * epoch, kept=names[max(0, epoch - 2) : epoch]
        )
    assert logger.close() == []
    client = MlflowClient(run.tracking_uri)
    held = [a.path for a in client.list_artifacts(run.run_id, "checkpoints")]
    assert held == ["checkpoints/epoch-0003.pt", "checkpoints/epoch-0004.pt"]

    def refuse(self, artifact_path, names):
        raise NotImplementedError("this artifact store does not delete")

    monkeypatch.setattr("ddpflow.tracking.one_try.OneTryCalls.keep_artifacts", refuse)
    logger = BackgroundMlflowLogger(run, tmp_path / "spool2", close_timeout_s=30)
    record_checkpoint(logger, "/ckpt/epoch-0005.pt", b"5", kept=["epoch-0005.pt"])
    logger.log_metrics({"train_loss": 0.5}, step=5)
    with caplog.at_level(logging.WARNING):
        assert logger.close() == [], "a refused delete is not an outage: later calls go on"
    assert "kept older copies" in caplog.text
    assert len(client.list_artifacts(run.run_id, "checkpoints")) == 3
    assert [m.step for m in client.get_metric_history(run.run_id, "train_loss")] == [5]
