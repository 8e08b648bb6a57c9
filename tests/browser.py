"""A real headless Chromium for tests, driven over the DevTools protocol on a pipe.

`chromium --remote-debugging-pipe` reads protocol messages from its fd 3 and writes them to
its fd 4, each a JSON object ended by a NUL byte: no websocket, no port, stdlib only.
`open_page` loads a URL and returns what a person opening it would have been told (console
errors, uncaught exceptions, error log entries), the URLs it fetched and the value of a
JavaScript expression evaluated once it has loaded.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

#: Debian's package (apt-get install chromium) puts a launcher here.
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@dataclass
class Page:
    """What loading a page gave: `errors` (console.error/assert, uncaught exceptions, log
    entries at level error, each a line of text), `requests` (every URL it fetched, data:
    URLs left out) and `value` (the expression's result, by value)."""

    errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    value: object = None


def _above_9(fd: int) -> int:
    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return high


class _Browser:
    def __init__(self, profile: Path, log: Path):
        to_r, self._to_w = os.pipe()
        self._from_r, from_w = os.pipe()
        # Chromium's ends move above 9 first, so putting them on 3 and 4 cannot clobber one
        # with the other.
        to_r, from_w = (_above_9(fd) for fd in (to_r, from_w))
        args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions",
                f"--user-data-dir={profile}", "--remote-debugging-pipe", "about:blank"]
        # The shell puts the pipe ends on fds 3 and 4, then becomes chromium (exec); bash, as
        # dash refuses fd numbers above 9.
        self._log = log.open("wb")
        self.proc = subprocess.Popen(["bash", "-c", f'exec "$@" 3<&{to_r} 4>&{from_w}', "sh", *args],
                                     pass_fds=(to_r, from_w), stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT)
        os.close(to_r)
        os.close(from_w)
        self._buf = b""
        self._next = 0
        self.events: list[dict] = []

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_r], [], [], left)[0]:
                raise TimeoutError("chromium did not answer on its DevTools pipe in time")
            chunk = os.read(self._from_r, 1 << 20)
            if not chunk:
                raise RuntimeError(f"chromium closed its DevTools pipe (exit {self.proc.poll()})")
            self._buf += chunk
        message, self._buf = self._buf.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float = 30) -> dict:
        """Send one command; events that arrive before its answer go to self.events."""
        self._next += 1
        message = {"id": self._next, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_w, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            answer = self._read(deadline)
            if answer.get("id") == self._next:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return answer.get("result", {})
            self.events.append(answer)

    def wait_for(self, method: str, timeout: float = 30) -> dict:
        deadline = time.monotonic() + timeout
        for event in self.events:
            if event.get("method") == method:
                return event
        while True:
            event = self._read(deadline)
            self.events.append(event)
            if event.get("method") == method:
                return event

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=10)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_w)
        os.close(self._from_r)
        self._log.close()


def _error_lines(events: list[dict]) -> list[str]:
    lines = []
    for e in events:
        method, p = e.get("method"), e.get("params", {})
        if method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            lines.append("console." + p["type"] + ": " + " ".join(
                str(a.get("value", a.get("description", ""))) for a in p.get("args", [])))
        elif method == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            lines.append("exception: " + str((d.get("exception") or {}).get("description") or d.get("text")))
        elif method == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            lines.append(f"log ({p['entry'].get('source')}): {p['entry'].get('text')} {p['entry'].get('url', '')}")
    return lines


def open_page(url: str, expression: str, timeout: float = 60) -> Page:
    """Load `url` in a fresh headless Chromium (its own profile), wait for the load event,
    evaluate `expression` (a promise is awaited) and return what the page reported."""
    if CHROMIUM is None:
        raise RuntimeError("chromium is not installed")
    with tempfile.TemporaryDirectory(prefix="remnant-chromium-") as tmp:
        browser = _Browser(Path(tmp) / "profile", Path(tmp) / "chromium.log")
        try:
            target = browser.call("Target.createTarget", {"url": "about:blank"})["targetId"]
            session = browser.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
            for domain in ("Runtime", "Log", "Page", "Network"):
                browser.call(f"{domain}.enable", session=session)
            browser.call("Page.navigate", {"url": url}, session=session)
            browser.wait_for("Page.loadEventFired", timeout=timeout)
            result = browser.call("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                       "awaitPromise": True}, session=session, timeout=timeout)
            page = Page(value=(result.get("result") or {}).get("value"))
            if "exceptionDetails" in result:
                page.errors.append(f"the test's expression threw: {result['exceptionDetails']}")
        except BaseException:
            browser.close()
            print((Path(tmp) / "chromium.log").read_text(errors="replace")[-4000:])
            raise
        browser.close()
    page.errors += _error_lines(browser.events)
    page.requests = [e["params"]["request"]["url"] for e in browser.events
                     if e.get("method") == "Network.requestWillBeSent"
                     and not e["params"]["request"]["url"].startswith("data:")]
    return page
