"""Credentials in URIs are hidden wherever a URI is shown: alone, chained, inside text, or in
what is left of a URL a parser split in the wrong place. Every query value is hidden, whatever
its name."""

import pytest

from ddpflow.storage.redact import (
    RedactedError,
    clean_cause,
    error_text,
    has_credentials,
    redact_text,
    redact_url,
    redacted_error,
)

SECRETS = (
    "PASSWORD",
    "KEY123",
    "TOKEN123",
    "p%40ss",
    "abc123",
    "deadbeef",
    "PW9",
    "SIG7",
    "ACC7",
    "eyJhbGciOi",
    "SAS5",
    "PRIV3",
    "S3CRETPW",
)


def assert_clean(text: str) -> None:
    assert not [secret for secret in SECRETS if secret in text], text


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        # user info
        ("https://user:PASSWORD@example.com/pets.json", "https://user:***@example.com/pets.json"),
        ("https://ghp_TOKEN123@github.com/o/r.json", "https://***@github.com/o/r.json"),
        ("https://:PASSWORD@example.com/x", "https://***@example.com/x"),
        ("http://u:p%40ss@host:8080/a?b=1#c", "http://u:***@host:8080/a?b=***#c"),
        ("http://u:PASSWORD@[::1]:8080/x", "http://u:***@[::1]:8080/x"),
        ("http://u:p@ss@host:5000/x", "http://u:***@host:5000/x"),  # an unencoded '@'
        # query parameters named like a credential, the words run together or not
        ("http://[fe80::1]:80/x?key=KEY123", "http://[fe80::1]:80/x?key=***"),
        ("https://example.com/p?token=abc123&x=1", "https://example.com/p?token=***&x=***"),
        ("https://h/p?accesstoken=ACC7", "https://h/p?accesstoken=***"),
        ("https://h/p?jwt=eyJhbGciOi.x.y", "https://h/p?jwt=***"),
        ("https://h/p?sas=SAS5", "https://h/p?sas=***"),
        ("https://h/p?privatekey=PRIV3&page=2", "https://h/p?privatekey=***&page=***"),
        ("https://h/p?Key=KEY123&AUTH=abc123", "https://h/p?Key=***&AUTH=***"),
        ("https://h/p?sessionToken=abc123", "https://h/p?sessionToken=***"),
        # any other name, and a value without a name
        ("https://h/p?x=SIG7&y=", "https://h/p?x=***&y="),
        ("https://h/p?TOKEN123", "https://h/p?***"),
        # signed URLs: S3 presigned, an Azure SAS (sv=...&sig=...)
        (
            "https://b.s3.amazonaws.com/k?X-Amz-Signature=deadbeef&x-amz-credential=KEY123",
            "https://b.s3.amazonaws.com/k?X-Amz-Signature=***&x-amz-credential=***",
        ),
        (
            "https://acct.blob.core.windows.net/c/b?sv=2024-08-04&se=2030&sp=r&sig=SIG7%3D",
            "https://acct.blob.core.windows.net/c/b?sv=***&se=***&sp=***&sig=***",
        ),
        # fragments carry tokens too (OAuth's implicit grant)
        ("https://h/cb#access_token=abc123&state=s", "https://h/cb#access_token=***&state=***"),
        (
            "http://alice:PASSWORD@127.0.0.1:1/missing.json?key=KEY123#frag",
            "http://alice:***@127.0.0.1:1/missing.json?key=***#frag",
        ),
        # fsspec chains
        ("simplecache::https://user:PW9@host/x.json", "simplecache::https://user:***@host/x.json"),
        ("zip://a.json::https://h/a.zip?sig=SIG7", "zip://a.json::https://h/a.zip?sig=***"),
        (
            "filecache::s3://bucket/x::https://u:PW9@[::1]:9/y",
            "filecache::s3://bucket/x::https://u:***@[::1]:9/y",
        ),
        # a URL urlsplit refuses (a broken IPv6 host) is redacted as text
        ("http://u:PASSWORD@[::1/x?sig=SIG7", "http://***@[::1/x?sig=***"),
    ],
)
def test_redact_url_hides_credentials(url: str, expected: str) -> None:
    redacted = redact_url(url)
    assert redacted == expected
    assert_clean(redacted)
    assert has_credentials(url)
    assert redact_url(redacted) == redacted  # redacting twice changes nothing


@pytest.mark.parametrize(
    "url",
    [
        "/data/pets.json",
        "relative/pets.json",
        "/weird/path@with-at.json",
        "/odd/name?key=1.json",
        "s3://bucket/prefix/pets.json",
        "https://example.com/#/runs/0123abcd",
        "http://[::1]:8080/x",
        "simplecache::https://example.com/x.json",
        "sqlite:////tmp/mlflow.db",
        "file:///tmp/pets.json",
        "models:/charlm@champion",
        "",
    ],
)
def test_redact_url_leaves_urls_without_credentials_unchanged(url: str) -> None:
    assert redact_url(url) == url
    assert not has_credentials(url)


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        # urllib's error for http://user:S3CRETPW@mlflow.internal/health: no URL left in it
        (
            "InvalidURL: nonnumeric port: 'S3CRETPW@mlflow.internal'",
            "InvalidURL: nonnumeric port: '***@mlflow.internal'",
        ),
        ("nonnumeric port: 'PASSWORD@localhost'", "nonnumeric port: '***@localhost'"),
        ("nonnumeric port: 'p%40ss@10.0.0.5:5000'", "nonnumeric port: '***@10.0.0.5:5000'"),
        # a network location without its scheme
        ("connect to //alice:PASSWORD@db.internal/x", "connect to //alice:***@db.internal/x"),
        ("proxy //TOKEN123@[::1]:3128 refused", "proxy //***@[::1]:3128 refused"),
        # MLflow's own errors quote the request URL, the tracking URI's user:password@ in it
        (
            "API request to http://alice:PASSWORD@127.0.0.1:5000/api/2.0/mlflow/runs/create "
            "failed with exception HTTPConnectionPool(host='127.0.0.1', port=5000): "
            "Max retries exceeded with url: /api/2.0/mlflow/runs/create",
            "API request to http://alice:***@127.0.0.1:5000/api/2.0/mlflow/runs/create "
            "failed with exception HTTPConnectionPool(host='127.0.0.1', port=5000): "
            "Max retries exceeded with url: /api/2.0/mlflow/runs/create",
        ),
        (
            "source 'http://alice:PASSWORD@h/missing.json?key=KEY123' does not exist "
            "(404, url='https://TOKEN123@github.com/x'); tried simplecache::s3://b/k?sig=SIG7.",
            "source 'http://alice:***@h/missing.json?key=***' does not exist "
            "(404, url='https://***@github.com/x'); tried simplecache::s3://b/k?sig=***",
        ),
        ("GET https://h/x?jwt=eyJhbGciOi failed", "GET https://h/x?jwt=*** failed"),
        # a path an error quotes, its scheme gone (fsspec's FileNotFoundError)
        (
            "FileNotFoundError: /alice:PASSWORD@b.example/k.pt?sig=SIG7&sv=1",
            "FileNotFoundError: /***@b.example/k.pt?sig=***&sv=***",
        ),
    ],
)
def test_redact_text_scrubs_urls_and_what_is_left_of_them(text: str, shown: str) -> None:
    assert redact_text(text) == shown
    assert_clean(redact_text(text))
    assert redact_text(shown) == shown


def test_redact_text_leaves_plain_text_alone() -> None:
    text = (
        "open http://127.0.0.1:5000/#/runs/abc; epoch 3: loss 1.2 (key=value in prose); "
        "alias models:/charlm@champion; worker tcp://127.0.0.1:40123 left; @flow"
    )
    assert redact_text(text) == text


def test_error_text_names_the_type_and_redacts_the_message() -> None:
    error = ConnectionError("GET http://u:PASSWORD@h/x?sas=SAS5 failed")
    assert error_text(error) == "ConnectionError: GET http://u:***@h/x?sas=*** failed"
    assert error_text(TimeoutError()) == "TimeoutError"


def test_clean_cause_drops_a_cause_whose_chain_repeats_a_secret() -> None:
    inner = OSError("GET http://u:PASSWORD@h/x failed")
    try:
        raise ValueError("wrapped") from inner
    except ValueError as outer:
        assert clean_cause(outer) is None
    assert clean_cause(inner) is None
    assert clean_cause(ValueError("nonnumeric port: 'S3CRETPW@mlflow.internal'")) is None
    plain = OSError("connection refused")
    assert clean_cause(plain) is plain


# One row per spelling of redact.TEXT_PATTERNS (and the ones around them that must stay).
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Authorization: Basic YWxpY2U6S3gtOTM=", "Authorization: Basic ***"),
        ("{'Authorization': 'Bearer eyJhbGciOi.x.y'}", "{'Authorization': 'Bearer ***'}"),
        ("headers={'authorization': 'token TOKEN123'}", "headers={'authorization': 'token ***'}"),
        ("sent Bearer eyJhbGciOiJIUzI1 to the API", "sent Bearer *** to the API"),
        ("aws_secret_access_key=S3CRETPW/xyz+", "aws_secret_access_key=***"),
        ("AWS_SECRET_ACCESS_KEY='S3CRETPW'", "AWS_SECRET_ACCESS_KEY='***'"),
        ("login with password=PASSWORD now", "login with password=*** now"),
        ("MLFLOW_TRACKING_PASSWORD=PW9", "MLFLOW_TRACKING_PASSWORD=***"),
        ("PREFECT_API_AUTH_STRING=ddpflow:PW9", "PREFECT_API_AUTH_STRING=***"),
        ('{"token": "TOKEN123", "name": "pets"}', '{"token": "***", "name": "pets"}'),
        ('{"secretKey": "SAS5"}', '{"secretKey": "***"}'),
        ("api-key: KEY123", "api-key: ***"),
        ("client(private_key=PRIV3, region=eu)", "client(private_key=***, region=eu)"),
        ("the key AKIAIOSFODNN7ACC7XYZ is not yours", "the key *** is not yours"),
        ("InvalidURL: nonnumeric port: 'PW9'", "InvalidURL: nonnumeric port: '***'"),
        # A password with an unencoded / # or ?: a parser splits it before the '@'.
        ("http://alice:PW9/ACC7@host.example/x?k=KEY123", "http://alice:***@host.example/x?k=***"),
        ("http://alice:PW9#ACC7@host.example/x", "http://alice:***@host.example/x"),
        ("http://alice:PW9?ACC7@host.example/x", "http://alice:***@host.example/x"),
        # Not credentials: stay as they are.
        ("https://host.example:443/models/a@b", "https://host.example:443/models/a@b"),
        ("num_tokens=5 keyboard=3 max_restarts=2", "num_tokens=5 keyboard=3 max_restarts=2"),
        ("tokens: 12, secrets folder: none", "tokens: 12, secrets folder: none"),
    ],
)
def test_credentials_outside_urls_are_hidden(text: str, expected: str) -> None:
    assert redact_text(text) == expected


def test_a_tracking_uri_whose_password_has_a_slash_fails_preflight_naming_the_fix() -> None:
    """http.client takes `alice:PW9` for host and port and raises InvalidURL (no ValueError)
    before any connection: pre-flight names the fix and repeats no part of the password."""
    from ddpflow.preflight.checks import PreflightError, check_tracking

    with pytest.raises(PreflightError) as refused:
        check_tracking("http://alice:PW9/ACC7@127.0.0.1:9/", timeout_s=2)
    message = str(refused.value)
    assert "percent-encode" in message and "MLFLOW_TRACKING_URI" in message
    assert "PW9" not in message and "ACC7" not in message, message


def test_a_redacted_error_keeps_its_type_and_drops_a_chain_that_holds_the_secret() -> None:
    import torch.distributed as dist

    def raised(error: Exception, cause: Exception | None = None) -> Exception:
        try:
            raise error from cause
        except Exception as caught:  # noqa: BLE001 - the test's own raise
            return caught

    clean = raised(ValueError("no secret here"))
    assert redacted_error(clean) is clean
    url = "http://alice:PW-1@host:5000/api"
    chained = raised(dist.DistNetworkError("peer gone"), ConnectionError(url))
    safe = redacted_error(chained)
    assert type(safe) is dist.DistNetworkError and str(safe) == "peer gone"
    assert safe.__cause__ is None and safe.__suppress_context__
    assert safe.__traceback__ is chained.__traceback__  # where it was raised still shows
    own = redacted_error(raised(RuntimeError(f"cannot reach {url}")))
    assert type(own) is RuntimeError and str(own) == "cannot reach http://alice:***@host:5000/api"

    class TwoArgs(Exception):
        def __init__(self, code: int, url: str) -> None:
            super().__init__(f"{code}: {url}")

    odd = redacted_error(raised(TwoArgs(503, url)))
    assert isinstance(odd, RedactedError) and str(odd).startswith("TwoArgs: 503: ")
    assert "PW-1" not in str(odd)
