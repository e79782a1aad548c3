"""Keep credentials out of output, exceptions, MLflow params and Prefect records.

A URI can carry a secret in its user info (https://user:secret@host), in any query value
(?token=..., ?accesstoken=..., ?jwt=..., ?sv=...&sig=..., X-Amz-Signature=...: no list of
names can know them all, so every query value is hidden), in a fragment value
(#access_token=...) and, for fsspec, in any part of a chained URL
(simplecache::https://user:secret@host/x). :func:`redact_url` hides all of them and leaves the
rest as it was (scheme, host, port, path, parameter names), so a redacted URI still says
where the data came from.

Free text (an exception's message, a log line) is scrubbed by :func:`redact_text`: every URL
in it is redacted, and so is what only looks like part of one, such as `//user:pass@host`,
urllib's `nonnumeric port: 'secret@host'` or a path with a query string (/b/k?sig=...).
Outside URLs it hides the spellings of TEXT_PATTERNS: an `Authorization:` header's
credentials, a bearer token, `name=value` / `name: value` / `"name": "value"` where the name
ends in password, secret, token, a key word (`aws_secret_access_key`, `apiKey`) or
`auth_string`, and AWS access key ids.
Every error text that leaves a rank, a service or a library for a log, an MLflow tag, a
Prefect artifact or state goes through :func:`redact_text` (or :func:`error_text`, which
calls it).
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

MASK = "***"
# A URL inside free text: a scheme, '://', then anything up to whitespace or a quote.
_URL = r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>`]+"
# A network location's user info without a scheme: //user:password@ or //token@.
_SLASHED_USERINFO = r"//(?P<userinfo>[^\s/?#'\"<>`]+)@"
# What is left of a URL that a parser split in the wrong place, e.g. urllib's
# "nonnumeric port: 'secret@mlflow.internal'": anything@ a host name with a dot, an IP
# address, [IPv6], localhost or host:port. MLflow's models:/name@alias has no such host.
_BARE_USERINFO = (
    r"(?<![\w.%+~:@-])[^\s/?#'\"<>`()\[\]{},;=]+@"
    r"(?=\[|localhost\b|[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+|[A-Za-z0-9.-]+:\d)"
)
# A query string left in text without its scheme (a path an error quotes: /b/k?sig=...).
_BARE_QUERY = r"(?<=\S)\?(?P<query>[^\s'\"<>`#]*=[^\s'\"<>`#]*)"
# A name whose value is a credential: it ends in one of these words (any case, `_`/`-`
# between parts), so MLFLOW_TRACKING_PASSWORD, aws_secret_access_key, secretKey, api-key and
# PREFECT_API_AUTH_STRING match and num_tokens or keyboard do not.
_SECRET_NAME = (
    r"(?i:[A-Za-z0-9_.-]*?(?:passw(?:or)?d|pwd|secret|token|credentials?|"
    r"(?:api|access|secret|private|signing|session)[_-]?key|auth[_-]?string))"
)
# Each: (what it hides, the pattern; its group `secret` is replaced by ***).
TEXT_PATTERNS: tuple[tuple[str, str], ...] = (
    (
        "an Authorization header's credentials",
        r"(?i:authorization)['\"]?\s*[:=]\s*['\"]?(?i:basic|bearer|token|digest)\s+"
        r"(?P<secret>[^\s'\"]+)",
    ),
    ("a bearer token", r"\b(?i:bearer)\s+(?P<secret>[A-Za-z0-9+/=._~-]{8,})"),
    (
        "a quoted name and value (JSON, a dict's repr)",
        rf"['\"]{_SECRET_NAME}['\"]\s*:\s*['\"](?P<secret>[^'\"]+)['\"]",
    ),
    (
        "name=value or name: value (an environment line, a config file, keyword arguments)",
        rf"(?<![A-Za-z0-9_]){_SECRET_NAME}\s*[=:]\s*['\"]?(?P<secret>[^\s'\"&,;)}}\]]+)",
    ),
    # http.client's message for a password with an unencoded '/' (user:pa/ss@host).
    ("a password taken for a port", r"nonnumeric port: '(?P<secret>[^'@]+)'"),
    ("an AWS access key id", r"\b(?P<secret>(?:AKIA|ASIA|AIDA|AROA|AGPA|ANPA)[A-Z0-9]{16})\b"),
)
_IN_TEXT = re.compile(
    f"(?P<url>{_URL})|{_SLASHED_USERINFO}|(?P<bare>{_BARE_USERINFO})|{_BARE_QUERY}"
)
_SECRETS_IN_TEXT = [re.compile(pattern) for _, pattern in TEXT_PATTERNS]
# In a URL that cannot be parsed: user info after '//', and every query or fragment value.
_UNPARSED_USERINFO = re.compile(r"(?<=//)[^/?#]*@")
_UNPARSED_VALUE = re.compile(r"(?<=[?&#;])([^=&#\s]*)=[^&#\s]*")


def _redact_params(params: str, *, bare_values: bool) -> str:
    """Every `name=value` with its value masked. A query field without '=' is masked whole
    (`?TOKEN` is a value); a fragment without '=' is a page anchor or route (#/runs/1)."""
    fields = []
    for field in params.split("&"):
        name, sep, value = field.partition("=")
        if sep and value:
            field = f"{name}={MASK}"
        elif not sep and field and bare_values:
            field = MASK
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


def _mask_values(url: str) -> str:
    """Every query or fragment `name=value` of an unparsed URL with its value masked."""
    return _UNPARSED_VALUE.sub(lambda m: f"{m.group(1)}={MASK}", url)


def _redact_unparsed(url: str) -> str:
    """A URL urlsplit refuses (a broken [IPv6] host): redacted as text, the same parts."""
    return _mask_values(_UNPARSED_USERINFO.sub(f"{MASK}@", url))


def _redact_misparsed(url: str) -> str:
    """A URL whose "port" is no number: most often a password with an unencoded / # or ?
    (http://user:pa/ss@host), which a parser splits before its '@'. Everything from '://'
    to the last '@' is user info; without an '@' the URL is redacted as unparsable."""
    scheme, _, rest = url.partition("://")
    if "@" not in rest:
        return _redact_unparsed(url)
    return _mask_values(f"{scheme}://{_redact_netloc(rest)}")  # netloc: up to the last '@'


def _redact_one(url: str) -> str:
    if "://" not in url:
        return url  # a plain path: nothing in it is a credential field
    try:
        parts = urlsplit(url)
    except ValueError:
        return _redact_unparsed(url)
    try:
        parts.port  # noqa: B018 - raises for a port that is no number
    except ValueError:
        return _redact_misparsed(url)
    redacted = (
        parts.scheme,
        _redact_netloc(parts.netloc),
        parts.path,
        _redact_params(parts.query, bare_values=True),
        _redact_params(parts.fragment, bare_values=False),
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
    """The URL with its user info and every query value replaced by ***; a URL with neither
    is returned as is."""
    return "::".join(_redact_one(part) for part in _split_chain(url))


def _redact_match(match: re.Match[str]) -> str:
    if match.group("url"):
        return redact_url(match.group("url"))
    if match.group("bare"):
        return f"{MASK}@"
    if match.group("query") is not None:
        return "?" + _redact_params(match.group("query"), bare_values=True)
    return f"//{_redact_netloc(match.group('userinfo') + '@')}"


def _mask_secret(match: re.Match[str]) -> str:
    start, end = match.span("secret")
    whole = match.group(0)
    return whole[: start - match.start()] + MASK + whole[end - match.start() :]


def redact_text(text: str) -> str:
    """Free text (an error message, a log line) with every URL, every piece of one that
    carries user info, and every spelling of TEXT_PATTERNS redacted."""
    text = _IN_TEXT.sub(_redact_match, text)
    for pattern in _SECRETS_IN_TEXT:
        text = pattern.sub(_mask_secret, text)
    return text


def error_text(error: BaseException) -> str:
    """`Type: message` of an error, redacted: the one way an error's text is written into a
    log, an MLflow tag, a Prefect artifact or state. A library's message (MLflow's quotes
    the tracking URL, user:password@ included) is no safer than a rank's."""
    message = redact_text(str(error))
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def has_credentials(url: str) -> bool:
    """True when showing the URL would hide something: user info or a query value."""
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


class RedactedError(RuntimeError):
    """Stands in for an error whose own type cannot be rebuilt from a redacted message; its
    text starts with the original type's name."""


def redacted_error(error: Exception) -> Exception:
    """`error` where its text and its chain's hold no credential, else an error of the same
    type (where its constructor takes one message) with the redacted text, no chain.

    For errors raised where a copy is kept out of ddpflow's reach: Dask stores a failed
    task's exception on the scheduler and serves its text to whoever opens the dashboard's
    /info pages, so a rank's error is redacted before it leaves the rank. The type is kept
    where possible because what the supervisor does next depends on it.
    """
    if clean_cause(error) is error:
        return error
    message = redact_text(str(error))
    try:
        safe: Exception = type(error)(message)
        if str(safe) != message:  # a constructor that formats its arguments its own way
            raise TypeError(type(error).__name__)
    except Exception:  # noqa: BLE001 - any constructor that does not take one message
        safe = RedactedError(error_text(error))
    safe.__traceback__ = error.__traceback__
    safe.__suppress_context__ = True
    return safe
