"""Load a local HTML file in headless Chromium and report what a user would see, using only the standard library.

Chromium is driven over the Chrome DevTools Protocol on a pipe (``--remote-debugging-pipe``: it reads commands
on fd 3 and writes replies and events on fd 4, NUL-separated JSON), so no chromedriver, websocket package or
port is needed. The report lists page errors (uncaught exceptions, ``console.error``, browser log errors such as
a failed resource load), every non-local request (the dashboard must not touch the network), what each Plotly
figure rendered, and optionally a full-page PNG.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import select
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-extensions",
    "--mute-audio",
    "--hide-scrollbars",
]
LOCAL_SCHEMES = ("file:", "data:", "blob:", "about:", "chrome:", "devtools:")

# Per Plotly div: how many svg.main-svg and .plot-container it has, and whether its data traces drew anything.
_FIGURES_JS = """
JSON.stringify(Array.from(document.querySelectorAll('div.plotly-graph-div')).map(d => ({
  id: d.id,
  main_svg: d.querySelectorAll('svg.main-svg').length,
  plot_container: d.querySelectorAll('.plot-container').length,
  drawn: d.querySelectorAll('.scatterlayer .point, .barlayer .point, .heatmaplayer image, .hm image').length,
  width: d.getBoundingClientRect().width,
  height: d.getBoundingClientRect().height,
})))
"""


@dataclass
class PageReport:
    errors: list[str] = field(default_factory=list)
    remote_requests: list[str] = field(default_factory=list)
    figures: list[dict] = field(default_factory=list)
    screenshot: Path | None = None
    seconds: float = 0.0


class _Pipe:
    """CDP over Chromium's debugging pipe."""

    def __init__(self, to_browser: int, from_browser: int, proc: subprocess.Popen):
        self._w, self._r, self._proc = to_browser, from_browser, proc
        self._buf = b""
        self._next_id = 0
        self.events: list[dict] = []

    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no reply from Chromium over the debugging pipe")
            ready, _, _ = select.select([self._r], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(self._r, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"Chromium closed the debugging pipe (exit code {self._proc.poll()})")
                self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def send(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 15):
        self._next_id += 1
        msg: dict = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"CDP {method}: {reply['error']}")
                return reply.get("result", {})
            if "method" in reply:
                self.events.append(reply)

    def wait_event(self, method: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        if any(e["method"] == method for e in self.events):
            return True
        while time.monotonic() < deadline:
            try:
                msg = self._read_message(deadline)
            except TimeoutError:
                return False
            if "method" in msg:
                self.events.append(msg)
                if msg["method"] == method:
                    return True
        return False


def _high_fd(fd: int) -> int:
    """A copy of ``fd`` numbered >= 10, so the child's dup2 onto 3 and 4 cannot clobber it."""
    new = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return new


def _page_errors(events: list[dict]) -> list[str]:
    errors = []
    for e in events:
        method, p = e["method"], e.get("params", {})
        if method == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            desc = d.get("exception", {}).get("description") or d.get("text")
            errors.append(f"uncaught: {desc} (line {d.get('lineNumber')})")
        elif method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            args = " ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", []))
            errors.append(f"console.{p['type']}: {args}")
        elif method == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            entry = p["entry"]
            errors.append(f"log ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}".strip())
    return errors


def _drive(
    cdp: _Pipe, url: str, screenshot: str | Path | None, width: int, height: int, timeout: float
) -> PageReport:
    deadline = time.monotonic() + timeout
    report = PageReport()
    targets = cdp.send("Target.getTargets")["targetInfos"]
    page = next(t for t in targets if t["type"] == "page")
    attached = cdp.send("Target.attachToTarget", {"targetId": page["targetId"], "flatten": True})
    session = attached["sessionId"]
    for domain in ("Page", "Runtime", "Log", "Network"):
        cdp.send(f"{domain}.enable", session=session)
    cdp.send(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        session=session,
    )
    cdp.send("Page.navigate", {"url": url}, session=session)
    if not cdp.wait_event("Page.loadEventFired", max(deadline - time.monotonic(), 1)):
        report.errors.append(f"page did not finish loading within {timeout:.0f} s")

    def evaluate(expression: str):
        reply = cdp.send(
            "Runtime.evaluate", {"expression": expression, "returnByValue": True}, session=session
        )
        return reply["result"]["value"]

    while True:  # Plotly.newPlot is asynchronous: poll until every figure has its SVG layers
        report.figures = json.loads(evaluate(_FIGURES_JS))
        done = report.figures and all(f["main_svg"] and f["plot_container"] for f in report.figures)
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    time.sleep(0.3)  # let late errors arrive
    if screenshot is not None:
        full = int(evaluate("document.documentElement.scrollHeight"))
        shot = cdp.send(
            "Page.captureScreenshot",
            {
                "format": "png",
                "captureBeyondViewport": True,
                "clip": {"x": 0, "y": 0, "width": width, "height": min(full, 16000), "scale": 1},
            },
            session=session,
            timeout=max(deadline - time.monotonic(), 5),
        )
        report.screenshot = Path(screenshot)
        report.screenshot.write_bytes(base64.b64decode(shot["data"]))
    evaluate("1")  # a last round trip: every event sent before it has been read
    report.errors += _page_errors(cdp.events)
    report.remote_requests = [
        e["params"]["request"]["url"]
        for e in cdp.events
        if e["method"] == "Network.requestWillBeSent"
        and not e["params"]["request"]["url"].startswith(LOCAL_SCHEMES)
    ]
    with contextlib.suppress(RuntimeError, TimeoutError):
        cdp.send("Browser.close", timeout=5)
    return report


def load_page(
    html: str | Path,
    screenshot: str | Path | None = None,
    width: int = 1200,
    height: int = 3000,
    timeout: float = 25.0,
    binary: str = CHROMIUM,
) -> PageReport:
    """Open ``html`` (a local file) in headless Chromium, wait until every Plotly div has rendered (or
    ``timeout``), and report errors, remote requests and figures; write a full-page PNG to ``screenshot``."""
    start = time.monotonic()
    url = Path(html).resolve().as_uri()
    # Chromium's own stderr goes to a file, so a chatty browser never blocks on a full pipe.
    with tempfile.TemporaryDirectory(prefix="viasd-chromium-") as profile, tempfile.TemporaryFile() as log:
        cmd_r, cmd_w = os.pipe()  # we write commands -> Chromium reads fd 3
        evt_r, evt_w = os.pipe()  # Chromium writes fd 4 -> we read
        child_in, child_out = _high_fd(cmd_r), _high_fd(evt_w)

        def _wire_fds() -> None:  # runs in the child between fork and exec
            os.dup2(child_in, 3)
            os.dup2(child_out, 4)

        argv = [
            binary,
            *FLAGS,
            "--remote-debugging-pipe",
            f"--user-data-dir={profile}",
            f"--window-size={width},{height}",
            "about:blank",
        ]
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
            preexec_fn=_wire_fds,
            pass_fds=(3, 4),
        )
        os.close(child_in)
        os.close(child_out)
        try:
            report = _drive(_Pipe(cmd_w, evt_r, proc), url, screenshot, width, height, timeout)
        except (RuntimeError, TimeoutError) as e:
            log.seek(0)
            tail = log.read().decode(errors="replace")[-2000:]
            raise RuntimeError(f"{e}; Chromium's stderr ends with:\n{tail}") from e
        finally:
            os.close(cmd_w)
            os.close(evt_r)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    report.seconds = time.monotonic() - start
    return report
