"""How often the launcher asks the ranks' workers for their progress."""

from __future__ import annotations

import pytest

from ddpflow.distributed.supervisor.timings import DEFAULT_SUPERVISION
from ddpflow.distributed.supervisor.watch import stall_check_s

WORKER_CHECK_S = DEFAULT_SUPERVISION.worker_check_s
MAX_STALL_CHECK_S = DEFAULT_SUPERVISION.max_stall_check_s


# docs/fault-tolerance.md: every twentieth of the timeout, at least every WORKER_CHECK_S and
# at most every MAX_STALL_CHECK_S, so a stall is named at most 5 % (or 10 s) late.
@pytest.mark.parametrize(
    ("timeout_s", "expected"),
    [(5.0, WORKER_CHECK_S), (120.0, 6.0), (3600.0, MAX_STALL_CHECK_S)],
)
def test_the_stall_check_is_a_twentieth_of_the_timeout_within_bounds(timeout_s, expected):
    assert stall_check_s(timeout_s) == pytest.approx(expected)
    assert stall_check_s(timeout_s) <= max(timeout_s * 0.05, WORKER_CHECK_S)
