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
