"""Retries, URL redaction and settings from the environment."""

from pathlib import Path

import pytest

from ddpflow.config import (
    ARTIFACT_ROOT_ENV,
    DASK_ADDRESS_ENV,
    DASK_WORKERS_ENV,
    TRACKING_URI_ENV,
    ConfigError,
    Settings,
)
from ddpflow.storage.redact import redact_url
from ddpflow.storage.retry import retry_call

# --- retry_call -------------------------------------------------------------------------------


class Flaky:
    """Raises the given errors in order, then returns "ok"."""

    def __init__(self, *errors: BaseException):
        self.errors = list(errors)
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


@pytest.mark.parametrize(
    "error", [ConnectionError("reset"), TimeoutError("slow"), OSError("network down")]
)
def test_transient_errors_are_retried(error: BaseException) -> None:
    delays: list[float] = []
    fn = Flaky(error, error)
    assert retry_call(fn, what="x", attempts=4, base_delay_s=0.5, sleep=delays.append) == "ok"
    assert fn.calls == 3
    assert delays == [0.5, 1.0]


def test_gives_up_after_attempts_and_reraises_the_last_error() -> None:
    delays: list[float] = []
    errors = [ConnectionError(f"try {i}") for i in range(1, 5)]
    fn = Flaky(*errors, ConnectionError("never reached"))
    with pytest.raises(ConnectionError, match="try 4") as info:
        retry_call(fn, what="x", attempts=4, base_delay_s=0.5, sleep=delays.append)
    assert info.value is errors[3]
    assert fn.calls == 4
    assert delays == [0.5, 1.0, 2.0]


def test_delays_are_capped() -> None:
    delays: list[float] = []
    fn = Flaky(*[TimeoutError()] * 5)
    retry_call(fn, what="x", attempts=6, base_delay_s=1.0, max_delay_s=3.0, sleep=delays.append)
    assert delays == [1.0, 2.0, 3.0, 3.0, 3.0]


def test_success_first_time_does_not_sleep() -> None:
    delays: list[float] = []
    assert retry_call(lambda: 42, what="x", sleep=delays.append) == 42
    assert delays == []


@pytest.mark.parametrize(
    "error",
    [
        FileNotFoundError("missing"),
        PermissionError("denied"),
        IsADirectoryError("dir"),
        ValueError("bad"),
        KeyError("k"),
    ],
)
def test_permanent_errors_are_not_retried(error: BaseException) -> None:
    delays: list[float] = []
    fn = Flaky(error)
    with pytest.raises(type(error)) as info:
        retry_call(fn, what="x", attempts=5, sleep=delays.append)
    assert info.value is error
    assert fn.calls == 1
    assert delays == []


def test_single_attempt_does_not_retry() -> None:
    delays: list[float] = []
    fn = Flaky(ConnectionError("once"))
    with pytest.raises(ConnectionError, match="once"):
        retry_call(fn, what="x", attempts=1, sleep=delays.append)
    assert fn.calls == 1 and delays == []


def test_attempts_below_one_rejected() -> None:
    with pytest.raises(ValueError, match="attempts"):
        retry_call(lambda: 1, what="x", attempts=0, sleep=lambda _: None)


# --- redact_url -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("https://user:secret@example.com/pets.json", "https://user:***@example.com/pets.json"),
        ("https://ghp_TOKEN123@github.com/o/r.json", "https://***@github.com/o/r.json"),
        ("https://:secret@example.com/x", "https://***@example.com/x"),
        ("http://u:p%40ss@host:8080/a?b=1#c", "http://u:***@host:8080/a?b=***#c"),
        ("http://u:p@[::1]:8080/x", "http://u:***@[::1]:8080/x"),
        ("https://example.com/p?token=abc123&x=1", "https://example.com/p?token=***&x=***"),
        (
            "https://b.s3.amazonaws.com/k?X-Amz-Signature=deadbeef&X-Amz-Expires=60",
            "https://b.s3.amazonaws.com/k?X-Amz-Signature=***&X-Amz-Expires=***",
        ),
        ("https://example.com/pets.json?page=2", "https://example.com/pets.json?page=***"),
    ],
)
def test_redact_hides_credentials(url: str, expected: str) -> None:
    redacted = redact_url(url)
    assert redacted == expected
    for secret in ("secret", "TOKEN123", "p%40ss", "abc123", "deadbeef"):
        assert secret not in redacted


@pytest.mark.parametrize(
    "url",
    [
        "/data/pets.json",
        "relative/pets.json",
        "/weird/path@with-at.json",
        "s3://bucket/prefix/pets.json",
        "sqlite:////tmp/mlflow.db",
        "file:///tmp/pets.json",
        "",
    ],
)
def test_redact_leaves_urls_without_credentials_unchanged(url: str) -> None:
    assert redact_url(url) == url


# --- Settings.from_env ------------------------------------------------------------------------


def test_defaults(tmp_path: Path) -> None:
    settings = Settings.from_env(env={}, project_dir=tmp_path)
    project = tmp_path.resolve()
    assert settings.project_dir == project
    assert settings.artifact_root == str(project / "artifacts")
    assert settings.tracking_uri == f"sqlite:///{project}/mlflow.db"
    assert settings.tracking_uri.startswith("sqlite:////")  # absolute path form
    assert settings.num_dask_workers == 2
    assert settings.dask_address is None


def test_empty_values_fall_back_to_defaults(tmp_path: Path) -> None:
    env = {
        TRACKING_URI_ENV: "",
        DASK_ADDRESS_ENV: "",
        DASK_WORKERS_ENV: "  ",
        ARTIFACT_ROOT_ENV: "",
    }
    settings = Settings.from_env(env=env, project_dir=tmp_path)
    assert settings == Settings.from_env(env={}, project_dir=tmp_path)


def test_overrides(tmp_path: Path) -> None:
    env = {
        ARTIFACT_ROOT_ENV: str(tmp_path / "elsewhere"),
        TRACKING_URI_ENV: "http://127.0.0.1:5000",
        DASK_ADDRESS_ENV: "tcp://scheduler:8786",
        DASK_WORKERS_ENV: "4",
    }
    settings = Settings.from_env(env=env, project_dir=tmp_path)
    assert settings.artifact_root == str((tmp_path / "elsewhere").resolve())
    assert settings.tracking_uri == "http://127.0.0.1:5000"
    assert settings.dask_address == "tcp://scheduler:8786"
    assert settings.num_dask_workers == 4


def test_env_variable_names() -> None:
    assert ARTIFACT_ROOT_ENV == "DDPFLOW_ARTIFACT_ROOT"
    assert TRACKING_URI_ENV == "MLFLOW_TRACKING_URI"
    assert DASK_ADDRESS_ENV == "DDPFLOW_DASK_ADDRESS"
    assert DASK_WORKERS_ENV == "DDPFLOW_DASK_WORKERS"


def test_relative_artifact_root_is_made_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(tmp_path)  # a cwd other than the project folder
    settings = Settings.from_env(env={ARTIFACT_ROOT_ENV: "out/arts"}, project_dir=project)
    assert Path(settings.artifact_root).is_absolute()
    assert settings.artifact_root == str(project.resolve() / "out" / "arts")


def test_file_uri_artifact_root_becomes_a_path(tmp_path: Path) -> None:
    env = {ARTIFACT_ROOT_ENV: f"file://{tmp_path}/arts"}
    settings = Settings.from_env(env=env, project_dir=tmp_path)
    assert settings.artifact_root == str(tmp_path.resolve() / "arts")


@pytest.mark.parametrize(
    ("root", "expected"),
    [
        ("s3://bucket/prefix", "s3://bucket/prefix"),
        ("s3://bucket/prefix/", "s3://bucket/prefix"),
        ("  s3://bucket  ", "s3://bucket"),
    ],
)
def test_s3_artifact_root_is_kept(tmp_path: Path, root: str, expected: str) -> None:
    settings = Settings.from_env(env={ARTIFACT_ROOT_ENV: root}, project_dir=tmp_path)
    assert settings.artifact_root == expected


def test_blank_artifact_root_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=ARTIFACT_ROOT_ENV):
        Settings.from_env(env={ARTIFACT_ROOT_ENV: "   "}, project_dir=tmp_path)


@pytest.mark.parametrize("raw", ["0", "abc", "-1", "2.5"])
def test_bad_worker_count_names_the_variable(tmp_path: Path, raw: str) -> None:
    with pytest.raises(ConfigError) as info:
        Settings.from_env(env={DASK_WORKERS_ENV: raw}, project_dir=tmp_path)
    assert "DDPFLOW_DASK_WORKERS" in str(info.value)
    assert repr(raw) in str(info.value)


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(
    "root",
    [
        "s3://AKIAEXAMPLE:ROOTSECRET@bucket/prefix",
        "https://ROOTSECRET@files.example.com/artifacts",
        "https://files.example.com/artifacts?sig=ROOTSECRET",
    ],
)
def test_an_artifact_root_with_credentials_is_refused_without_quoting_them(
    root: str, tmp_path: Path
) -> None:
    """Every checkpoint URI (recorded in MLflow tags) starts with the root."""
    with pytest.raises(ConfigError) as info:
        Settings.from_env(env={"DDPFLOW_ARTIFACT_ROOT": root}, project_dir=tmp_path)
    message = str(info.value)
    assert "DDPFLOW_ARTIFACT_ROOT" in message and "AWS_ACCESS_KEY_ID" in message
    assert "ROOTSECRET" not in message
