"""Keep credentials out of output, exceptions, MLflow params and Prefect records.

A URI can carry a secret in three places: its user info (https://user:secret@host), a query
or fragment parameter named like a credential (?key=..., #access_token=..., presigned
X-Amz-Signature=...) and, for fsspec, in any part of a chained URL
(simplecache::https://user:secret@host/x). :func:`redact_url` hides all of them and leaves
everything else exactly as it was, so a redacted URI still says where the data came from.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

MASK = "***"
# Parameter names (split into words, case-insensitive) whose value is a credential.
_SECRET_WORDS = frozenset(
    {
        "key",
        "apikey",
        "token",
        "secret",
        "password",
        "passwd",
        "pwd",
        "pass",
        "auth",
        "authorization",
        "signature",
        "sig",
        "credential",
        "credentials",
        "session",
        "code",
    }
)
# Signed-URL parameter families: every member is hidden (credential, token, signature, ...).
_SECRET_PREFIXES = ("x-amz-", "x-goog-")
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")
# A URL inside free text: a scheme, '://', then anything up to whitespace or a quote.
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>`]+")


def is_secret_name(name: str) -> bool:
    """True for a parameter name such as key, access_token, X-Amz-Signature or sessionToken."""
    lowered = name.lower()
    if lowered.startswith(_SECRET_PREFIXES):
        return True
    return any(word.lower() in _SECRET_WORDS for word in _WORD.findall(name))


def _redact_params(params: str) -> str:
    fields = []
    for field in params.split("&"):
        name, sep, value = field.partition("=")
        if sep and value and is_secret_name(name):
            field = f"{name}={MASK}"
        fields.append(field)
    return "&".join(fields)


def _redact_netloc(netloc: str) -> str:
    if "@" not in netloc:
        return netloc
    userinfo, _, host = netloc.rpartition("@")
    user, has_password, _ = userinfo.partition(":")
    # A user with a password keeps the user name; a lone user part is usually a token
    # (https://TOKEN@github.com) and is hidden whole.
    return f"{user}:{MASK}@{host}" if has_password and user else f"{MASK}@{host}"


def _redact_one(url: str) -> str:
    if "://" not in url:
        return url  # a plain path: nothing in it is a credential field
    parts = urlsplit(url)
    redacted = (
        parts.scheme,
        _redact_netloc(parts.netloc),
        parts.path,
        _redact_params(parts.query),
        _redact_params(parts.fragment),
    )
    if redacted[1:] == (parts.netloc, parts.path, parts.query, parts.fragment):
        return url
    return urlunsplit(redacted)


def _split_chain(url: str) -> list[str]:
    """fsspec's '::' chain separators; a '::' inside [...] belongs to an IPv6 host."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(url):
        char = url[i]
        depth += (char == "[") - (char == "]")
        if depth == 0 and url.startswith("::", i):
            parts.append(url[start:i])
            start = i = i + 2
            continue
        i += 1
    return [*parts, url[start:]]


def redact_url(url: str) -> str:
    """The URL with every credential replaced by ***; a URL without one is returned as is."""
    return "::".join(_redact_one(part) for part in _split_chain(url))


def redact_text(text: str) -> str:
    """Free text (an error message, a log line) with every URL in it redacted."""
    return _URL_IN_TEXT.sub(lambda match: redact_url(match.group(0)), text)


def has_credentials(url: str) -> bool:
    return redact_url(url) != url


def clean_cause(error: BaseException) -> BaseException | None:
    """The error itself if its text and its chain's are free of credentials, else None.

    For `raise New(redacted message) from clean_cause(error)`: a traceback prints every
    chained error's text too, so a cause that repeats a secret is dropped, and the new
    error's message carries its redacted text instead.
    """
    link: BaseException | None = error
    while link is not None:
        text = str(link)
        if redact_text(text) != text:
            return None
        link = link.__cause__ or link.__context__
    return error
