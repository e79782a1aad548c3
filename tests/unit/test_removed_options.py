"""A keyword option the public API documented and later removed fails at the call with a
TypeError naming what replaced it (ddpflow/api.py REMOVED_OPTIONS, CHANGELOG.md), before
any other check or any work; the functions' signatures stay free of the removed names."""

from __future__ import annotations

import inspect
import typing

import pytest

import ddpflow
from ddpflow.api import REMOVED_OPTIONS


def train(ctx: ddpflow.TrainContext) -> None:
    pass


def test_run_with_progress_topic_names_on_event_and_how_to_move():
    # No client is needed to find out: the refusal comes before any check or work.
    with pytest.raises(TypeError) as info:
        ddpflow.run(object(), train, progress_topic="ddpflow-progress")
    text = str(info.value)
    assert "run() got an unexpected keyword argument 'progress_topic'" in text
    assert "on_event=" in text and "ddpflow.Progress" in text
    assert "0.2.0" in text


def test_run_in_flow_with_progress_topic_names_on_event_even_outside_a_flow():
    with pytest.raises(TypeError, match=r"run_in_flow\(\).*'progress_topic'.*on_event="):
        ddpflow.run_in_flow(train, progress_topic="ddpflow-progress")


def test_an_option_that_never_existed_gets_pythons_own_error():
    with pytest.raises(TypeError, match=r"^run\(\) got an unexpected keyword argument 'nope'$"):
        ddpflow.run(object(), train, nope=1)


def test_the_signature_and_hints_show_the_live_options_only():
    parameters = inspect.signature(ddpflow.run).parameters
    hints = typing.get_type_hints(ddpflow.run)
    assert "on_event" in parameters and "on_event" in hints
    for function, removed in REMOVED_OPTIONS.items():
        for name, message in removed.items():
            # A removed name that were still a parameter of run() would be refused by mistake.
            assert name not in parameters and name not in hints, f"{function}: {name}"
            replacements = {word.split("=")[0] for word in message.split() if "=" in word}
            assert replacements and replacements <= set(parameters), message
