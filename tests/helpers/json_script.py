"""A helper module run as a script of its own that prints its answer as JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from tests.helpers.paths import CHECKOUT


def json_answer(module: str, *args: str, timeout_s: float) -> dict[str, Any]:
    """Run `python -m module args...` from the checkout; its last line of output, as JSON
    (a failure shows the end of its stderr)."""
    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=CHECKOUT, capture_output=True, text=True, timeout=timeout_s, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
