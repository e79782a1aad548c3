"""Credentials in URIs are hidden wherever a URI is shown: alone, chained or inside text."""

import pytest

from ddpflow.storage.redact import clean_cause, has_credentials, redact_text, redact_url

SECRETS = ("PASSWORD", "KEY123", "TOKEN123", "p%40ss", "abc123", "deadbeef", "PW9", "SIG7")


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("https://user:PASSWORD@example.com/pets.json", "https://user:***@example.com/pets.json"),
        ("https://ghp_TOKEN123@github.com/o/r.json", "https://***@github.com/o/r.json"),
        ("https://:PASSWORD@example.com/x", "https://***@example.com/x"),
        ("http://u:p%40ss@host:8080/a?b=1#c", "http://u:***@host:8080/a?b=1#c"),
        ("http://u:PASSWORD@[::1]:8080/x", "http://u:***@[::1]:8080/x"),
        ("http://[fe80::1]:80/x?key=KEY123", "http://[fe80::1]:80/x?key=***"),
        ("https://example.com/p?token=abc123&x=1", "https://example.com/p?token=***&x=1"),
        ("https://h/p?Key=KEY123&AUTH=abc123", "https://h/p?Key=***&AUTH=***"),
        (
            "https://h/p?api_key=KEY123&access_token=abc123",
            "https://h/p?api_key=***&access_token=***",
        ),
        ("https://h/p?sessionToken=abc123&page=2", "https://h/p?sessionToken=***&page=2"),
        (
            "https://b.s3.amazonaws.com/k?X-Amz-Signature=deadbeef&x-amz-credential=KEY123",
            "https://b.s3.amazonaws.com/k?X-Amz-Signature=***&x-amz-credential=***",
        ),
        (
            "https://acct.blob.core/c/b?sv=2024&sig=SIG7",
            "https://acct.blob.core/c/b?sv=2024&sig=***",
        ),
        ("https://h/cb#access_token=abc123&state=s", "https://h/cb#access_token=***&state=s"),
        (
            "http://alice:PASSWORD@127.0.0.1:1/missing.json?key=KEY123#frag",
            "http://alice:***@127.0.0.1:1/missing.json?key=***#frag",
        ),
        ("simplecache::https://user:PW9@host/x.json", "simplecache::https://user:***@host/x.json"),
        (
            "zip://a.json::https://h/a.zip?sig=SIG7",
            "zip://a.json::https://h/a.zip?sig=***",
        ),
        (
            "filecache::s3://bucket/x::https://u:PW9@[::1]:9/y",
            "filecache::s3://bucket/x::https://u:***@[::1]:9/y",
        ),
    ],
)
def test_redact_url_hides_credentials(url: str, expected: str) -> None:
    redacted = redact_url(url)
    assert redacted == expected
    assert not any(secret in redacted for secret in SECRETS)
    assert has_credentials(url)


@pytest.mark.parametrize(
    "url",
    [
        "/data/pets.json",
        "relative/pets.json",
        "/weird/path@with-at.json",
        "/odd/name?key=1.json",
        "s3://bucket/prefix/pets.json",
        "https://example.com/pets.json?page=2&author=me&monkey=1",
        "https://example.com/#/runs/0123abcd",
        "http://[::1]:8080/x",
        "simplecache::https://example.com/x.json",
        "sqlite:////tmp/mlflow.db",
        "file:///tmp/pets.json",
        "",
    ],
)
def test_redact_url_leaves_urls_without_credentials_unchanged(url: str) -> None:
    assert redact_url(url) == url
    assert not has_credentials(url)


def test_redact_text_scrubs_every_url_in_a_message() -> None:
    text = (
        "source 'http://alice:PASSWORD@h/missing.json?key=KEY123' does not exist "
        "(404, url='https://TOKEN123@github.com/x'); tried simplecache::s3://b/k?sig=SIG7."
    )
    redacted = redact_text(text)
    assert not any(secret in redacted for secret in SECRETS)
    assert "source 'http://alice:***@h/missing.json?key=***' does not exist" in redacted
    assert "url='https://***@github.com/x'" in redacted


def test_redact_text_leaves_plain_text_alone() -> None:
    text = "open http://127.0.0.1:5000/#/runs/abc; epoch 3: loss 1.2 (key=value in prose)"
    assert redact_text(text) == text


def test_clean_cause_drops_a_cause_whose_chain_repeats_a_secret() -> None:
    inner = OSError("GET http://u:PASSWORD@h/x failed")
    try:
        raise ValueError("wrapped") from inner
    except ValueError as outer:
        assert clean_cause(outer) is None
    assert clean_cause(inner) is None
    plain = OSError("connection refused")
    assert clean_cause(plain) is plain
