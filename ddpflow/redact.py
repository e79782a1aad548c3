"""Keep credentials out of logs, MLflow params and Prefect parameters."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

# Query parameters whose value is a credential (?token=..., presigned S3 X-Amz-Signature=...).
_SECRET_QUERY_WORDS = ("token", "secret", "password", "passwd", "signature", "credential", "sig")


def _redact_query(query: str) -> str:
    fields = []
    for field in query.split("&"):
        key, sep, value = field.partition("=")
        if sep and value and any(w in key.lower() for w in _SECRET_QUERY_WORDS):
            field = f"{key}=***"
        fields.append(field)
    return "&".join(fields)


def redact_url(url: str) -> str:
    """Drop a password or token embedded in a URL (https://user:secret@host/...).

    A user with a password keeps the user name (https://user:***@host); a lone user part is
    usually a token (https://TOKEN@github.com) and is hidden whole. Query parameters named
    like a credential (token, signature, ...) keep their name but lose their value.
    """
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        user, has_password, _ = userinfo.partition(":")
        netloc = f"{user}:***@{host}" if has_password and user else f"***@{host}"
    query = _redact_query(parts.query) if parts.query else parts.query
    if netloc == parts.netloc and query == parts.query:
        return url
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
