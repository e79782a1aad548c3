"""Bad input across both workloads and the sweep: each row is refused by the check the flow
runs first, with a message naming the input and the fix, and nothing already stored changes.

The rows call the flows' own checks (parameter validation, settings, the corpus download,
the image folder format) directly; tests/integration/test_bad_inputs_cli.py runs a few of
them through `python -m flows.<name>` to prove the wiring.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ddpflow.config import ConfigError, Settings
from ddpflow.preflight.checks import PreflightError, check_artifact_store, check_tracking
from ddpflow.training.batching import MAX_SEED
from ddpflow.workloads.charlm.corpus import DEFAULT_CORPUS_PATH, CorpusError
from ddpflow.workloads.charlm.data import fetch_corpus, format_corpus
from ddpflow.workloads.vision.data import ImageSpec, format_image_folder
from ddpflow.workloads.vision.image_folder import DatasetError
from flows.params import (
    CharLMParams,
    ImageParams,
    ParameterError,
    SweepParams,
    validate_params,
)
from tests.helpers.pngs import png
from tests.unit.test_flow_params import VALID as CHARLM
from tests.unit.test_sweep_params import VALID as SWEEP
from tests.unit.test_vision_params import VALID as IMAGES

Snapshot = dict[str, tuple[int, int]]


@dataclass(frozen=True)
class Case:
    id: str
    run: Callable[[Path], Any]  # given the project folder
    error: type[Exception]
    names: str  # how the message names the bad input
    fix: str  # what the message tells the user to do


def image_folder(root: Path, classes: dict[str, list[bytes]]) -> str:
    for label, images in classes.items():
        (root / label).mkdir(parents=True, exist_ok=True)
        for i, data in enumerate(images):
            (root / label / f"{i}.png").write_bytes(data)
    return str(root)


def params(model: type, base: dict, **changes: Any) -> Callable[[Path], Any]:
    return lambda _: validate_params(model, {**base, **changes})


def settings(**env: str) -> Callable[[Path], Any]:
    return lambda project: Settings.from_env(env, project_dir=project)


def source(write: Callable[[Path], None]) -> Callable[[Path], Any]:
    def run(project: Path) -> Any:
        path = project / "inputs" / "names.json"
        path.parent.mkdir(exist_ok=True)
        write(path)
        try:
            return fetch_corpus(str(path), str(project / "artifacts"))
        finally:
            path.unlink()

    return run


def images(classes: dict[str, list[bytes]], max_bad: float = 0.5) -> Callable[[Path], Any]:
    def run(project: Path) -> Any:
        root = image_folder(project / "inputs" / f"imgs-{len(os.listdir(project))}", classes)
        spec = ImageSpec(8)
        return format_image_folder(root, str(project / "artifacts"), spec, 0.25, 0, max_bad)

    return run


def symlinked_class(project: Path) -> Any:
    root = Path(image_folder(project / "inputs" / "linked", {"a": [png(1), png(2)]}))
    elsewhere = image_folder(project / "elsewhere", {"b": [png(3), png(4)]})
    (root / "b").symlink_to(Path(elsewhere) / "b")
    return format_image_folder(str(root), str(project / "artifacts"), ImageSpec(8), 0.25, 0, 0)


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _sparse(size: int) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        with open(path, "wb") as file:
            file.truncate(size)  # no bytes written: the size alone must be refused

    return write


def root_under_a_file(project: Path) -> Any:
    """An artifact root nobody can create: a file sits where its parent folder would be
    (chmod would not do: the tests run as root, for whom every mode is writable)."""
    blocker = project / "inputs" / "not-a-folder"
    blocker.write_text("a file")
    try:
        return check_artifact_store(str(blocker / "artifacts"))
    finally:
        blocker.unlink()


GOOD, BAD = [png(10), png(20), png(30)], b"\x89PNG not an image"
CASES = [
    # train-charlm parameters
    # Pydantic's own message says what to pass instead: the bound a value broke, or that a
    # number must be finite (inf and nan are refused before any bound).
    Case("charlm-timeout-inf", params(CharLMParams, CHARLM, rank_timeout_s=float("inf")),
         ParameterError, "rank_timeout_s=inf: ", "Input should be a finite number"),
    Case("charlm-timeout-nan", params(CharLMParams, CHARLM, rank_timeout_s=float("nan")),
         ParameterError, "rank_timeout_s=nan: ", "Input should be a finite number"),
    Case("charlm-timeout-zero", params(CharLMParams, CHARLM, rank_timeout_s=0),
         ParameterError, "rank_timeout_s=0: ", "Input should be greater than 0"),
    Case("charlm-timeout-over", params(CharLMParams, CHARLM, rank_timeout_s=604801),
         ParameterError, "rank_timeout_s=604801: ", "less than or equal to 604800"),
    Case("charlm-seed-overflow", params(CharLMParams, CHARLM, seed=2 * 10**13),
         ParameterError, "seed=20000000000000: ", f"less than or equal to {MAX_SEED}"),
    Case("charlm-epochs-zero", params(CharLMParams, CHARLM, epochs=0),
         ParameterError, "epochs=0: ", "Input should be greater than or equal to 1"),
    Case("charlm-epochs-over", params(CharLMParams, CHARLM, epochs=10_001),
         ParameterError, "epochs=10001: ", "Input should be less than or equal to 10000"),
    Case("charlm-hidden-zero", params(CharLMParams, CHARLM, hidden_size=0),
         ParameterError, "hidden_size=0: ", "Input should be greater than or equal to 1"),
    Case("charlm-hidden-over", params(CharLMParams, CHARLM, hidden_size=8193),
         ParameterError, "hidden_size=8193: ", "Input should be less than or equal to 8192"),
    Case("charlm-min-workers", params(CharLMParams, CHARLM, world_size=2, min_workers=3),
         ParameterError, "min_workers=3", "lower min_workers or raise world_size"),
    # train-images parameters
    Case("images-batch-zero", params(ImageParams, IMAGES, batch_size=0),
         ParameterError, "batch_size=0: ", "Input should be greater than or equal to 1"),
    Case("images-lr-inf", params(ImageParams, IMAGES, lr=float("inf")),
         ParameterError, "lr=inf: ", "Input should be a finite number"),
    Case("images-lr-over", params(ImageParams, IMAGES, lr=10.5),
         ParameterError, "lr=10.5: ", "Input should be less than or equal to 10"),
    Case("images-seed-2-64", params(ImageParams, IMAGES, seed=2**64),
         ParameterError, f"seed={2**64}: ", f"less than or equal to {MAX_SEED}"),
    Case("images-max-image-mb-zero", params(ImageParams, IMAGES, max_image_mb=0),
         ParameterError, "max_image_mb=0: ", "Input should be greater than 0"),
    # sweep-charlm parameters
    Case("sweep-timeout-inf", params(SweepParams, SWEEP, rank_timeout_s=float("inf")),
         ParameterError, "rank_timeout_s=inf: ", "Input should be a finite number"),
    Case("sweep-seed-overflow", params(SweepParams, SWEEP, seed=MAX_SEED + 1),
         ParameterError, f"seed={MAX_SEED + 1}: ", f"less than or equal to {MAX_SEED}"),
    Case("sweep-seed-negative", params(SweepParams, SWEEP, seed=-1),
         ParameterError, "seed=-1: ", "Input should be greater than or equal to 0"),
    Case("sweep-lr-nan", params(SweepParams, SWEEP, lr=float("nan")),
         ParameterError, "lr=nan: ", "Input should be a finite number"),
    # settings, read by every flow
    Case("dask-workers-zero", settings(DDPFLOW_DASK_WORKERS="0"),
         ConfigError, "DDPFLOW_DASK_WORKERS='0'", "e.g. 2"),
    Case("cluster-bogus", settings(DDPFLOW_CLUSTER="bogus"),
         ConfigError, "DDPFLOW_CLUSTER='bogus'", "use one of local, address"),
    Case("cluster-options-not-json", settings(DDPFLOW_CLUSTER_OPTIONS="{n_workers: 2"),
         ConfigError, "DDPFLOW_CLUSTER_OPTIONS is not valid JSON", "set a JSON object"),
    Case("heal-timeout-inf", settings(DDPFLOW_HEAL_TIMEOUT_S="inf"),
         ConfigError, "DDPFLOW_HEAL_TIMEOUT_S='inf'", "e.g. 120"),
    Case("rank-resources-zero", settings(DDPFLOW_RANK_RESOURCES='{"GPU": 0}'),
         ConfigError, "DDPFLOW_RANK_RESOURCES", 'e.g. {"GPU": 1}'),
    # pre-flight, the first step of every flow (flows/preflight.py); the Dask address and
    # S3 rows are in tests/integration/test_bad_inputs_cli.py and test_s3.py
    Case("preflight-root-unwritable", root_under_a_file,
         PreflightError, "not-a-folder is not a writable folder", "set DDPFLOW_ARTIFACT_ROOT"),
    Case("preflight-sqlite-folder-missing",
         lambda p: check_tracking(f"sqlite:///{p / 'no-such-folder' / 'mlflow.db'}"),
         PreflightError, "no-such-folder does not exist", "Create it or set MLFLOW_TRACKING_URI"),
    # the pet-name source (train-charlm and sweep-charlm)
    Case("source-missing", lambda p: fetch_corpus(str(p / "nope.json"), str(p / "artifacts")),
         FileNotFoundError, "nope.json", "pass source= a local path"),
    Case("source-empty-corpus", source(lambda p: p.write_text("[]")),
         CorpusError, "names.json: no usable names", "expected a JSON list of name strings"),
    Case("source-not-json", source(lambda p: p.write_text("bella, max")),
         CorpusError, "names.json: not valid JSON", "expected a JSON list of name strings"),
    Case("source-fifo", source(_fifo),
         CorpusError, "names.json is not a regular file (it is a FIFO)",
         "pass a JSON file of names"),
    Case("source-over-cap", source(_sparse(101 * 2**20)),
         CorpusError, "names.json: 105906176 bytes", "over the 100 MiB cap"),
    # image folders (train-images)
    Case("images-one-class", images({"7": GOOD}),
         DatasetError, "only one class folder ('7')", "needs at least 2 classes"),
    Case("images-class-all-bad", images({"a": GOOD, "b": [BAD]}, max_bad=0.5),
         DatasetError, "'b'", "add images or remove the folder"),
    Case("images-too-many-bad", images({"a": GOOD, "b": [*GOOD, BAD]}, max_bad=0.0),
         DatasetError, "b/3.png", "raise max_bad_fraction"),
    Case("images-symlinked-class", symlinked_class,
         DatasetError, "'b'", "copy or bind-mount the images into the folder"),
]  # fmt: skip


def snapshot(root: Path) -> Snapshot:
    """Every stored file with its size and modification time (inputs made by rows aside)."""
    found = {}
    for path in root.rglob("*"):
        rel = path.relative_to(root)
        if rel.parts[0] not in ("inputs", "elsewhere") and path.is_file():
            found[str(rel)] = (path.stat().st_size, path.stat().st_mtime_ns)
    return found


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A project that already stores things: a formatted corpus and image folder, a run's
    checkpoint, an MLflow database file. Shared: the rows must not change any of it."""
    root = tmp_path_factory.mktemp("project")
    artifacts = str(root / "artifacts")
    raw = fetch_corpus(str(DEFAULT_CORPUS_PATH), artifacts)
    format_corpus(raw.uri, artifacts, 0.1)
    folder = image_folder(root / "seeded-images", {"a": GOOD, "b": GOOD})
    format_image_folder(folder, artifacts, ImageSpec(8), 0.25, 0, 0.0)
    (root / "artifacts" / "runs" / "r1").mkdir(parents=True)
    (root / "artifacts" / "runs" / "r1" / "latest.json").write_text(json.dumps({"epoch": 3}))
    (root / "mlflow.db").write_bytes(b"SQLite format 3\0 stand-in")
    (root / "inputs").mkdir()
    return root


def test_the_table_covers_both_workloads_the_sweep_and_settings() -> None:
    assert len(CASES) >= 20
    prefixes = {case.id.split("-")[0] for case in CASES}
    assert {"charlm", "images", "sweep", "source", "cluster", "dask"} <= prefixes


@pytest.mark.timeout(60)  # a read that blocks (a FIFO source) fails the row, not the run
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_named_with_its_fix_and_nothing_stored_changes(
    case: Case, project: Path
) -> None:
    before = snapshot(project)
    assert any(key.startswith("artifacts/data") for key in before)
    with pytest.raises(case.error) as raised:
        case.run(project)
    message = str(raised.value)
    assert case.names in message, message
    assert case.fix in message, message
    assert snapshot(project) == before
