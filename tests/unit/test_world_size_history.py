"""The size a training ended at and every size it ran at, as the summaries and the MLflow
run's tags state them (docs/fault-tolerance.md "Growing when workers join")."""

from __future__ import annotations

from mlflow.tracking import MlflowClient

from ddpflow.distributed.supervisor.relaunch import Resize
from ddpflow.tracking.run import (
    FINAL_WORLD_SIZE_TAG,
    WORLD_SIZES_TAG,
    log_world_sizes,
    start_run,
    world_size_history,
    world_sizes_text,
)


def test_the_history_runs_from_the_first_launch_to_the_ranks_that_returned():
    grow, loss = Resize(2, 3, "joined", ["w3"]), Resize(3, 2, "lost", ["w3"])
    assert world_size_history([grow, loss], final=2) == (2, 3, 2)
    assert world_size_history([grow], final=3) == (2, 3)
    assert world_size_history([], final=2) == (2,)


def test_the_summary_line_names_the_final_size_then_the_history():
    assert world_sizes_text((2, 3, 2)) == "2 ranks (2 → 3 → 2)"
    assert world_sizes_text((2, 3)) == "3 ranks (2 → 3)"
    assert world_sizes_text((2,)) == "2 ranks", "unchanged: the line it always was"


def test_a_grown_image_summary_names_3_ranks_and_the_history():
    from ddpflow.config import Settings
    from flows.train_images import ImageSummary

    summary = ImageSummary(
        run_id="r", val_accuracy=0.5, val_loss=1.1, num_val=24, num_skipped=0,
        checkpoint_uri="/ckpt/epoch-0002.pt", checkpoint_dir="/ckpt", report_dir="/reports",
        model_version="1", world_size=3, world_sizes=(2, 3),
    )  # fmt: skip
    assert "  world size         3 ranks (2 → 3)\n" in summary.render(Settings.from_env({}))


def test_the_run_is_tagged_with_the_final_size_and_the_history(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = start_run(uri, "sizes", "grown", {"world_size": 2}, {}, str(tmp_path / "artifacts"))
    log_world_sizes(run, (2, 3, 2))
    found = MlflowClient(uri).get_run(run.run_id).data
    assert found.tags[FINAL_WORLD_SIZE_TAG] == "2"
    assert found.tags[WORLD_SIZES_TAG] == "2 → 3 → 2"
    assert found.params["world_size"] == "2", "the launched size stays a param"
