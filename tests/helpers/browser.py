"""Headless Chromium driven over the DevTools protocol (CDP), for pages behind a login.

`chromium --dump-dom` (tests/integration/test_inspection.py) renders a page but cannot answer
HTTP basic auth nor type into a form. Here the test holds the browser: it answers the basic-auth
challenges of the origins it was given credentials for, as a user types them into the
browser's dialog (CDP's Fetch domain; any other origin's challenge is cancelled, as a user
closing the dialog), runs JavaScript in the page, and reads what the page shows.

    with open_browser(profile_dir, logins={"http://127.0.0.1:5000": ("user", "pw")}) as page:
        page.goto(url)
        text = page.wait_for_text("run name")

One websocket (websockets' sync client) to the browser, one page attached to it with a
flattened session; events are handled whenever the test waits for an answer or for the page.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from websockets.sync.client import ClientConnection, connect

WINDOW = "1400,1000"
CALL_TIMEOUT_S = 30.0
START_TIMEOUT_S = 30.0


class BrowserError(RuntimeError):
    """The browser answered a command with an error, or did not answer in time."""


def chromium() -> str:
    """Debian's chromium (.ci/run installs it); outside CI its absence skips."""
    path = shutil.which("chromium")
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is not installed (apt-get install -y chromium)")
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    return path


class Page:
    """One tab of a headless Chromium, with the logins it answers basic auth with."""

    def __init__(
        self, socket: ClientConnection, logins: Mapping[str, tuple[str, str]], shots: Path | None
    ):
        self._socket = socket
        # origin -> (user, password) for its basic-auth dialog; a test may add one later.
        self.logins = dict(logins)
        self._shots = shots  # where a failed wait saves what the page showed
        self._last_id = 0
        self._session: str | None = None
        # request id -> challenges it met: a refused login asks again, and is cancelled then.
        self._asked: dict[str, int] = {}
        self.challenges: list[str] = []  # the origins that asked for a login, in order

    def attach(self) -> None:
        target = self.call("Target.createTarget", {"url": "about:blank"}, session=False)
        attached = self.call(
            "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}, False
        )
        self._session = attached["sessionId"]
        # Every request pauses until it is continued, so the auth challenges reach the test.
        self.call("Fetch.enable", {"handleAuthRequests": True, "patterns": [{"urlPattern": "*"}]})
        self.call("Page.enable")

    # ---- the protocol ------------------------------------------------------------------

    def call(
        self, method: str, params: dict[str, Any] | None = None, session: bool = True
    ) -> dict[str, Any]:
        """Send a command and wait for its answer, handling the events that come first."""
        sent = self._send(method, params, session)
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while True:
            message = self._receive(deadline)
            if message is None:
                raise BrowserError(f"{method}: no answer in {CALL_TIMEOUT_S:.0f} s")
            if message.get("id") == sent:
                if "error" in message:
                    raise BrowserError(f"{method}: {message['error']}")
                return message.get("result", {})

    def _send(self, method: str, params: dict[str, Any] | None, session: bool = True) -> int:
        self._last_id += 1
        message: dict[str, Any] = {"id": self._last_id, "method": method, "params": params or {}}
        if session and self._session is not None:
            message["sessionId"] = self._session
        self._socket.send(json.dumps(message))
        return self._last_id

    def _receive(self, deadline: float) -> dict[str, Any] | None:
        """The next message (its events handled), or None once the deadline passed."""
        try:
            raw = self._socket.recv(timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            return None
        message = json.loads(raw)
        if "method" in message:
            self._on_event(message["method"], message.get("params", {}))
        return message

    def _on_event(self, method: str, params: dict[str, Any]) -> None:
        if method == "Fetch.requestPaused":
            self._send("Fetch.continueRequest", {"requestId": params["requestId"]})
        elif method == "Fetch.authRequired":
            request, challenge = params["requestId"], params["authChallenge"]
            self.challenges.append(challenge["origin"])
            self._asked[request] = self._asked.get(request, 0) + 1
            login = self.logins.get(challenge["origin"])
            if login is None or self._asked[request] > 1:  # no login, or it was refused
                answer: dict[str, str] = {"response": "CancelAuth"}
            else:
                answer = {"response": "ProvideCredentials", "username": login[0]}
                answer["password"] = login[1]
            self._send(
                "Fetch.continueWithAuth", {"requestId": request, "authChallengeResponse": answer}
            )

    def pump(self, seconds: float) -> None:
        """Let the page run for `seconds`, handling its requests."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self._receive(deadline)

    # ---- what a test does --------------------------------------------------------------

    def goto(self, url: str) -> None:
        answer = self.call("Page.navigate", {"url": url})
        if answer.get("errorText"):
            raise BrowserError(f"{url}: {answer['errorText']}")

    def reload(self) -> None:
        self.call("Page.reload", {"ignoreCache": True})

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (a promise is awaited)."""
        answer = self.call(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
        )
        if "exceptionDetails" in answer:
            raise BrowserError(f"{expression[:80]}: {answer['exceptionDetails']}")
        return answer["result"].get("value")

    def text(self) -> str:
        """What the page shows: the body's text as rendered ('' while there is none)."""
        try:
            return self.evaluate("document.body ? document.body.innerText : ''") or ""
        except BrowserError:  # the page is between two documents
            return ""

    def url(self) -> str:
        try:
            return self.evaluate("location.href") or ""
        except BrowserError:
            return ""

    def wait_for_text(
        self, *needles: str, timeout_s: float = 60.0, refuse: Sequence[str] = ()
    ) -> str:
        """The page's text once it shows every needle; fails with what it shows instead, at
        once if it shows one of `refuse` (an error message)."""
        deadline = time.monotonic() + timeout_s
        shown = ""
        while time.monotonic() < deadline:
            shown = self.text()
            if all(needle in shown for needle in needles):
                return shown
            refused = [message for message in refuse if message in shown]
            if refused:
                raise AssertionError(
                    f"{self.url()} shows {refused} instead of {list(needles)}"
                    f"{self._failure_shot()}:\n{shown[-3000:]}"
                )
            self.pump(0.5)
        raise AssertionError(
            f"after {timeout_s:.0f} s {self.url()} does not show {list(needles)}"
            f"{self._failure_shot()}; it shows:\n{shown[-3000:]}"
        )

    def fill(self, selector: str, value: str) -> None:
        """Type `value` into the input `selector` (as typing does: an input event follows)."""
        script = f"""(() => {{
            const input = document.querySelector({json.dumps(selector)});
            if (!input) throw new Error("no element matches " + {json.dumps(selector)});
            const setter = Object.getOwnPropertyDescriptor(HTMLInputElement.prototype, "value").set;
            setter.call(input, {json.dumps(value)});
            input.dispatchEvent(new Event("input", {{bubbles: true}}));
        }})()"""
        self.evaluate(script)

    def click(self, selector: str) -> None:
        script = f"""(() => {{
            const element = document.querySelector({json.dumps(selector)});
            if (!element) throw new Error("no element matches " + {json.dumps(selector)});
            element.click();
        }})()"""
        self.evaluate(script)

    def wait_for_element(self, selector: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if self.evaluate(f"!!document.querySelector({json.dumps(selector)})"):
                    return
            except BrowserError:
                pass
            self.pump(0.5)
        raise AssertionError(
            f"after {timeout_s:.0f} s {self.url()} has no {selector}{self._failure_shot()}; "
            f"it shows:\n{self.text()[-3000:]}"
        )

    def _failure_shot(self) -> str:
        """A screenshot of the page as a wait gave up (named in its message), if wanted."""
        if self._shots is None:
            return ""
        path = self._shots / f"failed-{time.strftime('%H%M%S')}.png"
        try:
            self.screenshot(path)
        except BrowserError:
            return ""
        return f" (screenshot {path})"

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", {"format": "png"})["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))


@contextmanager
def open_browser(
    profile: Path,
    logins: Mapping[str, tuple[str, str]] | None = None,
    shots: Path | None = None,
) -> Iterator[Page]:
    """A headless Chromium with a fresh profile in `profile` and one page; `logins` maps an
    origin (`http://127.0.0.1:5000`) to the (user, password) its basic-auth dialog gets;
    `shots`: a folder for a screenshot of a page a wait gave up on. The browser and every
    process it started are stopped at the end."""
    profile.mkdir(parents=True, exist_ok=True)
    argv = [
        chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
        f"--window-size={WINDOW}", "--no-first-run", "--no-default-browser-check",
        "--no-proxy-server", "--remote-debugging-port=0", f"--user-data-dir={profile}",
        "about:blank",
    ]  # fmt: skip
    log = (profile.parent / f"{profile.name}-chromium.log").open("wb")
    process = subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True)
    try:
        socket = connect(
            _devtools_url(profile, process), max_size=None, proxy=None, open_timeout=30
        )
        with socket:
            page = Page(socket, logins or {}, shots)
            page.attach()
            yield page
    finally:
        _stop(process)
        log.close()


def _devtools_url(profile: Path, process: subprocess.Popen[bytes]) -> str:
    """The browser's websocket, from the DevToolsActivePort file it writes once listening."""
    active = profile / "DevToolsActivePort"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        lines = active.read_text().splitlines() if active.exists() else []
        if len(lines) >= 2:
            return f"ws://127.0.0.1:{lines[0]}{lines[1]}"
        if process.poll() is not None:
            raise BrowserError(f"chromium exited with {process.returncode} (see its log)")
        time.sleep(0.1)
    raise BrowserError(f"chromium wrote no {active} in {START_TIMEOUT_S:.0f} s")


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Stop the browser's process group (it leads its own session): its renderers too."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=10)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        pass
    try:  # whatever outlived the browser, or the browser itself if it hung
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    process.wait(timeout=10)
