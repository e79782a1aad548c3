"""The champion/challenger rule shared by retraining and sweeps."""

from __future__ import annotations

import pytest

from ddpflow.workloads.charlm.champion import Decision, decide


@pytest.mark.parametrize(
    ("challenger", "champion", "margin", "promoted", "reason"),
    [
        (1.5, None, 0.0, True, "no champion yet"),
        (1.5, 1.6, 0.0, True, "beats champion 1.6000"),
        (1.5, 1.6, 0.2, False, "does not beat"),
        (1.5, 1.5, 0.0, False, "does not beat"),
        (1.7, 1.5, 0.0, False, "does not beat"),
        (float("nan"), None, 0.0, False, "not a finite number"),
        (float("inf"), 1.5, 0.0, False, "not a finite number"),
        # A NaN champion compares false with everything: it must lose, not block forever.
        (1.5, float("nan"), 0.0, True, "champion loss nan is not a finite number"),
        (1.5, float("nan"), 10.0, True, "any challenger with a finite loss (1.5000)"),
        (1.5, float("inf"), 0.0, True, "champion loss inf is not a finite number"),
        (float("nan"), float("nan"), 0.0, False, "challenger loss nan is not a finite"),
    ],
)
def test_promotes_only_a_better_challenger(challenger, champion, margin, promoted, reason):
    result, why = decide(challenger, champion, margin)
    assert result is promoted
    assert reason in why


def test_decision_tags_record_both_scores_and_the_margin():
    tags = Decision(True, "no champion yet", "3", 1.25, None, None, 0.05).as_tags()
    assert tags["ddpflow.retrain.promoted"] == "True"
    assert tags["ddpflow.retrain.challenger_loss"] == "1.25"
    assert tags["ddpflow.retrain.champion_version"] == "None"
    assert tags["ddpflow.retrain.margin"] == "0.05"
