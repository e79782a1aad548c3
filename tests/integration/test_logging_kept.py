"""Importing ddpflow leaves the process's logging alone: warnings stay visible."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.paths import CHECKOUT

pytestmark = pytest.mark.integration


def test_importing_tracking_keeps_warnings_visible():
    # docs/fault-tolerance.md: an MLflow that is down is reported (a warning), never hidden.
    # mlflow.pytorch sets the root logger to ERROR at import; a Dask worker or a script that
    # imports ddpflow.tracking.run before configuring logging would lose every ddpflow warning.
    code = (
        "import logging, ddpflow.tracking.run; "
        "logging.getLogger('ddpflow.tracking.run').warning('the run stays RUNNING'); "
        "print(logging.getLogger().level, len(logging.getLogger().handlers))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=CHECKOUT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "the run stays RUNNING" in done.stderr
    assert done.stdout.split() == [str(30), "0"], "root logger: WARNING, no handler added"
