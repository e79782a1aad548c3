"""flows.summary.print_last: a flow's summary is held until the flow engine's own last line of
its flow run, then logged right after it (the deployment run's --watch for real:
integration/test_deployments.py)."""

from __future__ import annotations

import logging

import pytest

from flows.summary import _AfterEngineLine, print_last


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((getattr(record, "flow_run_id", ""), record.getMessage()))


def test_the_summary_follows_the_engines_last_line_of_its_own_flow_run():
    logger = logging.getLogger("tests.unit.summary_last")
    kept = Kept()
    logger.addHandler(kept)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    ours = logging.LoggerAdapter(logger, {"flow_run_id": "run-a"})
    other = logging.LoggerAdapter(logger, {"flow_run_id": "run-b"})
    held = _AfterEngineLine(logger, "run-a", ours, ["summary"])
    logger.addFilter(held)
    try:
        ours.info("epoch 1/1 done")
        other.info("Finished in state Completed()")  # another flow run's: not ours
        ours.info("Finished in state Completed()")
        ours.info("a line after it")  # the filter has left
    finally:
        logger.removeHandler(kept)
        logger.removeFilter(held)
    assert kept.lines == [
        ("run-a", "epoch 1/1 done"),
        ("run-b", "Finished in state Completed()"),
        ("run-a", "Finished in state Completed()"),
        ("run-a", "summary"),
        ("run-a", "a line after it"),
    ]
    assert held not in logger.filters


def test_outside_a_flow_run_the_summary_is_printed_at_once(capsys: pytest.CaptureFixture[str]):
    print_last("\nddpflow: done\n")
    assert capsys.readouterr().out == "\nddpflow: done\n"
