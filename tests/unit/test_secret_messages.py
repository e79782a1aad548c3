"""No message the project makes (errors, warnings, summaries, recorded flow parameters)
repeats a credential embedded in a URI."""

from __future__ import annotations

import logging
import socket
import traceback
from typing import Any

import pytest

from ddpflow.preflight.checks import PreflightError, check_tracking
from ddpflow.storage.retry import retry_call
from ddpflow.workloads.charlm.corpus import CorpusError, parse_names
from flows.cli import _redacted
from flows.params import (
    CharLMParams,
    ImageParams,
    ParameterError,
    SweepParams,
    validate_params,
)
from flows.summary import mlflow_ui_hint
from tests.unit.test_flow_params import VALID as CHARLM
from tests.unit.test_sweep_params import VALID as SWEEP
from tests.unit.test_vision_params import VALID as IMAGES

PASSWORD, KEY = "Pw-7q1xZ", "Kx-93vQ"
SECRET_URL = f"http://alice:{PASSWORD}@example.com/names.json?key={KEY}#frag"
SHOWN = "http://alice:***@example.com/names.json?key=***#frag"


def assert_clean(text: str) -> None:
    assert PASSWORD not in text and KEY not in text, text


def printed(error: BaseException) -> str:
    """The error as a traceback shows it, every chained error included."""
    return "".join(traceback.format_exception(error))


@pytest.mark.parametrize("data", [b"{not json", b'{"a": 1}', b"\xff\xfe", b'["", "!!"]'])
def test_corpus_errors_name_the_source_redacted(data: bytes) -> None:
    with pytest.raises(CorpusError) as info:
        parse_names(data, SECRET_URL)
    assert SHOWN in str(info.value)
    assert_clean(printed(info.value))


def test_corpus_error_redacts_whatever_message_it_is_given() -> None:
    assert_clean(str(CorpusError(f"cannot use {SECRET_URL}")))


def test_retry_warnings_redact_the_target_and_the_error(caplog) -> None:
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError(f"reset while reading {SECRET_URL}")
        return "ok"

    with caplog.at_level(logging.WARNING):
        assert retry_call(flaky, what=f"download {SECRET_URL}", sleep=lambda _: None) == "ok"
    assert "retry 2/" in caplog.text and SHOWN in caplog.text
    assert_clean(caplog.text)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_preflight_error_for_a_tracking_uri_with_user_and_password() -> None:
    uri = f"http://alice:{PASSWORD}@127.0.0.1:{closed_port()}/?token={KEY}"
    with pytest.raises(PreflightError, match="MLFLOW_TRACKING_URI") as info:
        check_tracking(uri, timeout_s=5)
    assert "alice:***@127.0.0.1" in str(info.value)
    assert_clean(printed(info.value))


def test_summary_hint_shows_the_tracking_uri_redacted() -> None:
    hint = mlflow_ui_hint(f"https://alice:{PASSWORD}@mlflow.example.com", "abc123")
    assert hint == (
        "open https://alice:***@mlflow.example.com/#/runs/abc123?workflowType=machine_learning"
    )


@pytest.mark.parametrize(
    ("model", "values", "field"),
    [
        (CharLMParams, {**CHARLM, "source": SECRET_URL}, "source"),
        (CharLMParams, {**CHARLM, "source": f"simplecache::{SECRET_URL}"}, "source"),
        (CharLMParams, {**CHARLM, "source": f"https://h/x.json?X-Amz-Signature={KEY}"}, "source"),
        # Names that run words together, and names no list would know: every query value.
        (CharLMParams, {**CHARLM, "source": f"https://h/x.json?accesstoken={KEY}"}, "source"),
        (CharLMParams, {**CHARLM, "source": f"https://h/x.json?jwt={KEY}"}, "source"),
        (SweepParams, {**SWEEP, "source": f"https://h/x.json?sas={KEY}"}, "source"),
        (SweepParams, {**SWEEP, "source": f"https://h/x.json?privatekey={KEY}"}, "source"),
        (CharLMParams, {**CHARLM, "source": f"https://a.blob/c/x?sv=1&sig={KEY}"}, "source"),
        (CharLMParams, {**CHARLM, "source": f"https://h/x.json?v={KEY}"}, "source"),
        (SweepParams, {**SWEEP, "source": f"  {SECRET_URL} "}, "source"),
        (ImageParams, {**IMAGES, "source": f"https://{KEY}@example.com/images"}, "source"),
        (ImageParams, {**IMAGES, "weights": f"https://h/w.pt?token={KEY}"}, "weights"),
    ],
)
def test_uri_parameters_with_credentials_are_refused_naming_the_fix(
    model: type, values: dict[str, Any], field: str
) -> None:
    with pytest.raises(ParameterError) as info:
        validate_params(model, values)
    message = str(info.value)
    assert f"{field}=" in message
    assert "can carry a credential" in message and "~/.netrc" in message
    assert "AWS_ACCESS_KEY_ID" in message and "***" in message
    assert_clean(printed(info.value))


def test_uri_parameters_without_credentials_pass() -> None:
    for source in ("s3://bucket/names.json", "https://example.com/names.json", "/data/a?b=1"):
        assert validate_params(CharLMParams, {**CHARLM, "source": source}).source == source


def test_the_command_line_hands_prefect_a_refused_uri_redacted_and_still_refused() -> None:
    """Prefect records a flow run's parameters before it validates them. The command line
    (flows.cli) hands it a set the model refuses redacted: what Prefect records and logs holds
    no credential, and the redacted value is refused with the same explanation."""
    given = {
        "source": SECRET_URL,
        "grid": {"uris": [SECRET_URL, f"https://h/x?accesstoken={KEY}&jwt={KEY}"]},
        "epochs": "3",
    }
    handed = _redacted(given)
    assert handed == {
        "source": SHOWN,
        "grid": {"uris": [SHOWN, "https://h/x?accesstoken=***&jwt=***"]},
        "epochs": "3",
    }
    with pytest.raises(ParameterError, match="source=.*can carry a credential") as info:
        validate_params(SweepParams, handed)
    assert_clean(printed(info.value))
