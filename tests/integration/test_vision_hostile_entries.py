"""A FIFO, /dev/zero and a link out of the folder among an image folder's entries: the
format names each and reads none. It runs in a child process with an address-space limit,
since an unguarded read of /dev/zero would take all the memory there is."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from ddpflow.workloads.vision.data import MANIFEST
from tests.helpers.pngs import png
from tests.unit.test_vision_objects import two_classes

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SPECIAL = ["cat/fifo.png", "cat/zero.png", "dog/escape.png"]
CHILD = """
import json, sys
from ddpflow.workloads.vision.data import ImageSpec, format_image_folder

root, artifacts, max_bad = sys.argv[1], sys.argv[2], float(sys.argv[3])
try:
    result = format_image_folder(root, artifacts, ImageSpec(8), 0.25, 0, max_bad)
    print(json.dumps({"bad": result.bad, "num_files": result.num_files}))
except Exception as error:
    print(json.dumps({"error": f"{type(error).__name__}: {error}"}))
"""


@pytest.fixture
def hostile(tmp_path: Path) -> Path:
    """Two classes of real PNGs plus a FIFO, a link to /dev/zero and a link out of the root."""
    root = two_classes(tmp_path / "images")
    os.mkfifo(root / "cat" / "fifo.png")
    os.symlink("/dev/zero", root / "cat" / "zero.png")
    outside = tmp_path / "private.png"
    outside.write_bytes(png(1))
    os.symlink(outside, root / "dog" / "escape.png")
    return root


def _format_in_child(root: Path, artifacts: Path, max_bad: float) -> dict:
    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, 4 * 2**30))

    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), str(artifacts), str(max_bad)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limit_memory,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(300)
def test_fifo_dev_zero_and_escaping_link_are_named_never_read(hostile, tmp_path) -> None:
    artifacts = tmp_path / "artifacts"
    strict = _format_in_child(hostile, artifacts, 0.0)
    assert "3 of 11 image files" in strict["error"] and "max_bad_fraction" in strict["error"]
    for key in SPECIAL:
        assert str(hostile / key) in strict["error"]
    assert not artifacts.exists(), "a failed format stores nothing"

    lenient = _format_in_child(hostile, artifacts, 0.5)
    reasons = {b["key"]: b["reason"] for b in lenient["bad"]}
    assert sorted(reasons) == SPECIAL and lenient["num_files"] == 11
    assert "not a regular file (a FIFO)" in reasons["cat/fifo.png"]
    for key in ("cat/zero.png", "dog/escape.png"):  # /dev/zero is outside the folder too
        assert "outside the image folder" in reasons[key]
    manifest = next(artifacts.rglob(MANIFEST)).read_text()
    assert all(key in manifest for key in SPECIAL), "the manifest names every skipped entry"
