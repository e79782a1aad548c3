"""What the flows print at the end: where to look next, as the flow run's last log line."""

from __future__ import annotations

import inspect
import logging
from typing import Any

from prefect.context import FlowRunContext
from prefect.logging import get_run_logger
from prefect.logging.handlers import APILogWorker

from ddpflow.storage.redact import redact_url
from ddpflow.tracking.inspection import TRAINING_VIEW, run_url

log = logging.getLogger(__name__)
# The flow engine's own last line of a flow run (prefect/flow_engine.py, Prefect 3.8): logged
# after the final state is set and the task runner (Dask client or cluster) has closed.
ENGINE_LAST_LINE = "Finished in state "
SEND_TIMEOUT_S = 10.0


def mlflow_ui_hint(tracking_uri: str, run_id: str, experiment_id: str | None = None) -> str:
    """Where to see the run; a tracking URI's credentials are shown as ***.

    With the run's experiment the link opens the Model training view: MLflow 3.17 redirects
    a bare `#/runs/<id>` to the run's experiment without the link's query, and a fresh
    browser then shows the GenAI view."""
    tracking_uri = redact_url(tracking_uri)
    server = tracking_uri if tracking_uri.startswith(("http://", "https://")) else None
    base = (server or "http://127.0.0.1:5000").rstrip("/")
    if experiment_id is not None:
        link = run_url(base, experiment_id, run_id)
    else:
        link = f"{base}/#/runs/{run_id}{TRAINING_VIEW}"
    if server is not None:
        return f"open {link}"
    return (
        f".venv/bin/mlflow ui --backend-store-uri {tracking_uri} --host 127.0.0.1 "
        f"--port 5000   then open {link}"
    )


def kept_line(files: int, num_bytes: int) -> str:
    """What a run's checkpoint folder keeps, for the summary: the same count is in MLflow."""
    return f"{files} kept, {num_bytes / 1e6:.1f} MB; MLflow holds the same epoch-end ones"


def print_last(text: str) -> None:
    """Log `text`, a flow's summary, as the last line of its flow run's log.

    `prefect deployment run … --watch` and `prefect flow-run logs` then end with it (only
    the CLI's verdict follows: docs/deployments.md). Outside a flow run it is printed at
    once. In one,
    the Dask workers first send the log lines they still hold (the task runs' own last
    lines, which Prefect batches every 2 s); the text then waits for the engine's last line
    ("Finished in state Completed()"), and is logged, on the flow run's logger, right after.
    """
    context = FlowRunContext.get()
    text = text.rstrip()  # as Prefect logs a print
    if context is None or context.flow_run is None:
        print(text)
        return
    _send_workers_logs(context.task_runner)
    run_logger = get_run_logger()
    logger = logging.getLogger("prefect.flow_runs")  # the engine's and get_run_logger()'s
    run_id = str(context.flow_run.id)
    for held in logger.filters:
        if isinstance(held, _AfterEngineLine) and held.run_id == run_id:
            held.texts.append(text)
            return
    logger.addFilter(_AfterEngineLine(logger, run_id, run_logger, [text]))


class _AfterEngineLine(logging.Filter):
    """On the flow runs' logger: lets the engine's last line of one flow run through, then
    logs the held texts after it, and leaves."""

    def __init__(
        self, logger: logging.Logger, run_id: str, run_logger: Any, texts: list[str]
    ) -> None:
        super().__init__()
        self.logger, self.run_id, self.run_logger, self.texts = logger, run_id, run_logger, texts

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(
            record, "flow_run_id", None
        ) != self.run_id or not record.getMessage().startswith(ENGINE_LAST_LINE):
            return True
        self.logger.removeFilter(self)
        self.logger.handle(record)  # the engine's line first, through every other filter
        for text in self.texts:
            self.run_logger.info(text)
        return False


def _send_workers_logs(task_runner: Any) -> None:
    """Have the flow's Dask workers send the Prefect log lines they hold to the API now."""
    client = getattr(task_runner, "_client", None)  # prefect-dask's, once it has started
    if client is None or getattr(client, "asynchronous", False):
        return
    try:
        client.run(send_held_logs, on_error="ignore", callback_timeout=SEND_TIMEOUT_S + 5)
    except Exception as error:  # noqa: BLE001 - the summary comes anyway, maybe not last
        log.debug("the workers' log lines were not sent first: %s", error)


async def send_held_logs() -> None:
    """On a Dask worker: send every log line Prefect holds for its API (at most
    SEND_TIMEOUT_S); the next line starts a new sender."""
    waiting = APILogWorker.drain_all(timeout=SEND_TIMEOUT_S, at_exit=False)
    if inspect.isawaitable(waiting):
        await waiting
