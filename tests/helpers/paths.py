"""Where the checkout is, for tests and the processes they start."""

from __future__ import annotations

from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]
