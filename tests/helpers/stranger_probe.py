"""What a local user other than the stack's can do to its SeaweedFS; run as that user.

    python3 -c "$(cat stranger_probe.py)" '<targets as JSON>'

Standard library only (the stranger runs the system's Python, not the stack's venv). Every
attempt is printed as one JSON object: what was tried and what came back, `refused: ...`
when no route ran (a connection, handshake or permission refused) or the HTTP status and
the start of the body when the server answered.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import ssl
import sys
from urllib.parse import urlsplit

BODY_SHOWN = 160


def http_attempt(method: str, url: str, headers: dict | None = None, body: bytes = b"") -> str:
    parts = urlsplit(url)
    if parts.scheme == "https":
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE  # trust anything; show no certificate of our own
        conn = http.client.HTTPSConnection(parts.hostname, parts.port, timeout=5, context=context)
    else:
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=5)
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    try:
        conn.request(method, path or "/", body=body or None, headers=headers or {})
        resp = conn.getresponse()
        text = resp.read(BODY_SHOWN).decode(errors="replace")
        return f"answered {resp.status}: {text}"
    except (OSError, http.client.HTTPException) as exc:
        return f"refused: {type(exc).__name__}: {exc}"
    finally:
        conn.close()


def tls_attempt(port: int) -> str:
    """A TLS client without a certificate, speaking first (a gRPC client's preface)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
            context.wrap_socket(raw) as tls,
        ):
            tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            data = tls.recv(64)
            return f"answered {data!r}" if data else "refused: closed"
    except (ssl.SSLError, OSError) as exc:
        return f"refused: {type(exc).__name__}: {exc}"


def unix_attempt(path: str) -> str:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5)
            sock.connect(path)
            return "answered: connected"
    except OSError as exc:
        return f"refused: {type(exc).__name__}: {exc}"


def folder_attempt(path: str) -> str:
    try:
        return f"answered: {sorted(os.listdir(path))[:5]}"
    except OSError as exc:
        return f"refused: {type(exc).__name__}: {exc}"


def main() -> None:
    targets = json.loads(sys.argv[1])
    attempts = []
    for item in targets["http"]:
        answer = http_attempt(
            item["method"], item["url"], item.get("headers"), item.get("body", "").encode()
        )
        attempts.append(
            {"what": f"{item['what']}: {item['method']} {item['url']}", "answer": answer}
        )
    for port in targets["tls_ports"]:
        attempts.append(
            {"what": f"TLS without a certificate to :{port}", "answer": tls_attempt(port)}
        )
    for path in targets["sockets"]:
        attempts.append({"what": f"unix socket {path}", "answer": unix_attempt(path)})
    for path in targets["folders"]:
        attempts.append({"what": f"folder {path}", "answer": folder_attempt(path)})
    print(json.dumps({"uid": os.getuid(), "attempts": attempts}))


if __name__ == "__main__":
    main()
