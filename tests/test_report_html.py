"""The HTML report in a real headless browser: loads without console errors, tables sort on a
real mouse click, charts render to non-blank pixels.

Chromium is driven through the DevTools protocol over `--remote-debugging-pipe` (NUL-separated
JSON on fds 3 and 4), so no websocket client is needed.
"""

from __future__ import annotations

import base64
import io
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from npuprep.report.render_html import render

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="no /usr/bin/chromium: install Debian's chromium (apt-get install -y chromium) "
           "to run the browser check; .ci/run installs it",
)


class Browser:
    """A headless chromium with one page, spoken to over the DevTools pipe."""

    def __init__(self, tmp: Path) -> None:
        cmd_read, self._cmd_write = os.pipe()
        self._res_read, res_write = os.pipe()

        def wire_pipes() -> None:
            # Chromium reads commands on fd 3 and writes replies on fd 4.
            os.dup2(cmd_read, 100)
            os.dup2(res_write, 101)
            os.dup2(100, 3)
            os.dup2(101, 4)

        self._log = open(tmp / "chromium.log", "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--no-first-run", "--no-default-browser-check", "--hide-scrollbars", "--mute-audio",
             f"--user-data-dir={tmp / 'profile'}", "--remote-debugging-pipe", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log,
            preexec_fn=wire_pipes, pass_fds=(3, 4),
        )
        os.close(cmd_read)
        os.close(res_write)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []
        # The first answer waits for the browser to start, slow on a loaded CI machine.
        target = self.call("Target.createTarget", {"url": "about:blank"}, timeout=60)["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page.enable", "Runtime.enable", "Log.enable"):
            self.call(domain, session=self.session)
        self.call("Emulation.setDeviceMetricsOverride",
                  {"width": 1200, "height": 900, "deviceScaleFactor": 1, "mobile": False},
                  session=self.session)

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._res_read], [], [], left)[0]:
                raise TimeoutError("chromium did not answer in time")
            chunk = os.read(self._res_read, 1 << 20)
            if not chunk:
                raise RuntimeError("chromium closed the DevTools pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, params: dict[str, Any] | None = None, *, session: str | None = None,
             timeout: float = 15.0) -> dict[str, Any]:
        self._next_id += 1
        request: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            request["sessionId"] = session
        os.write(self._cmd_write, json.dumps(request).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            message = self._read_message(deadline)
            if message.get("id") == self._next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self.events.append(message)

    def wait_for(self, event: str, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(e.get("method") == event for e in self.events):
            self.events.append(self._read_message(deadline))

    def open(self, url: str) -> None:
        self.events.clear()
        self.call("Page.navigate", {"url": url}, session=self.session)
        self.wait_for("Page.loadEventFired")

    def evaluate(self, expression: str) -> Any:
        reply = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True},
                          session=self.session)
        if "exceptionDetails" in reply:
            raise RuntimeError(f"page script failed: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    def click(self, selector: str) -> None:
        """A real mouse click (pressed + released) at the centre of the element."""
        x, y = self.evaluate(
            f"(function(){{var e=document.querySelector({json.dumps(selector)});"
            "e.scrollIntoView({block:'center'});var r=e.getBoundingClientRect();"
            "return [r.x+r.width/2, r.y+r.height/2];})()")
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", {"type": kind, "x": x, "y": y, "button": "left",
                                                   "clickCount": 1}, session=self.session)

    def screenshot(self, selector: str) -> bytes:
        """PNG of one element (page coordinates, beyond the viewport if needed)."""
        x, y, w, h = self.evaluate(
            f"(function(){{var r=document.querySelector({json.dumps(selector)})"
            ".getBoundingClientRect();return [r.x+window.scrollX, r.y+window.scrollY, r.width, r.height];})()")
        assert w > 100 and h > 100, f"{selector} has no size on the page: {w}x{h}"
        shot = self.call("Page.captureScreenshot",
                         {"format": "png", "captureBeyondViewport": True,
                          "clip": {"x": x, "y": y, "width": w, "height": h, "scale": 1}},
                         session=self.session)
        return base64.b64decode(shot["data"])

    def console_errors(self) -> list[str]:
        errors = []
        for e in self.events:
            method, params = e.get("method"), e.get("params", {})
            if method == "Runtime.exceptionThrown":
                details = params.get("exceptionDetails", {})
                errors.append(details.get("exception", {}).get("description") or details.get("text", ""))
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                errors.append(" ".join(str(a.get("value", a.get("description", "")))
                                       for a in params.get("args", [])))
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                errors.append(params["entry"].get("text", ""))
        return errors

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=5)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._cmd_write)
        os.close(self._res_read)
        self._log.close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("chromium")
    b = Browser(tmp)
    yield b
    b.close()
    shutil.rmtree(tmp / "profile", ignore_errors=True)


def _convert_result() -> dict[str, Any]:
    """A convert result over the chain x -> Conv -> Mul(x, x) -> ReduceSum -> Exp -> Div -> y,
    where ReduceSum overflows FP16 before the remedies and fits after."""
    chain = [("c", "conv", "Conv", 120.0, 120.0, 1e-6), ("sq", "square", "Mul", 1.4e4, 875.0, 2e-5),
             ("s", "sum", "ReduceSum", 9.0e5, 56250.0, 3e-4), ("e", "exp", "Exp", 3.0e4, 200.0, 0.15),
             ("y", "div", "Div", 0.8, 0.8, 0.015)]
    errors = [{"tensor": t, "node": n, "op_type": o, "max_abs": rel * 10, "rel_l2": rel,
               "cosine": 1 - rel, "absmax": after, "limit": 32752.0, "headroom": 32752.0 / after,
               "nonfinite": 0, "saturated": 0, "passed": rel < 0.01, "isolated_rel_l2": rel / 10}
              for t, n, o, _, after, rel in chain]
    profile = {"name": "generic", "default_precision": "fp16", "headroom": 0.5}
    return {
        "schema_version": 1, "kind": "convert", "fingerprint": "f00d", "model": "m.onnx",
        "output": "m16.onnx", "target": "generic", "profile": profile,
        "tensors": [{"tensor": t, "node": n, "op_type": o, "absmax_before": b, "absmax_after": a}
                    for t, n, o, b, a, _ in chain],
        "actions": [{"action": "rescale", "entry": "square", "k": 4, "domain": {"sq": 1, "s": 1},
                     "why": "sum overflows fp16"},
                    {"action": "pin_fp32", "nodes": ["exp"], "why": "exp of a wide range"}],
        "findings": [
            {"rule": "hazard.exp", "severity": "warning", "node": "exp", "op_type": "Exp",
             "tensor": "e", "message": "exp overflows above 11.09", "remedy": "pin_fp32"},
            {"rule": "range.overflow", "severity": "error", "node": "sum", "op_type": "ReduceSum",
             "tensor": "s", "message": "9e5 > 65504", "remedy": "rescale"},
            {"rule": "dtype.slow", "severity": "info", "node": "conv", "op_type": "Conv",
             "tensor": "", "message": "slow dtype", "remedy": "none"},
        ],
        "compare": {"schema_version": 1, "kind": "compare", "fingerprint": "f00d", "passed": False,
                    "first_divergent": {"node": "exp", "op_type": "Exp", "tensor": "e"},
                    "tensors": errors},
    }


def _column(browser: Browser, table: str, col: int) -> list[str]:
    return browser.evaluate(
        f"Array.from(document.querySelectorAll('#table-{table} tbody tr'))"
        f".map(function(r){{return r.cells[{col}].textContent;}})")


def _non_white_share(png: bytes) -> tuple[float, int, int]:
    """Share of pixels that are not near-white, distinct colours, and strongly red pixels."""
    from PIL import Image

    rgb = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).reshape(-1, 3).astype(int)
    non_white = int((rgb.min(axis=1) < 235).sum())
    red = int(((rgb[:, 0] > 150) & (rgb[:, 1] < 90) & (rgb[:, 2] < 90)).sum())
    return non_white / len(rgb), len(np.unique(rgb, axis=0)), red


def test_console_errors_are_caught(browser: Browser) -> None:
    # The listener itself must work, or "no console errors" below would prove nothing.
    page = "<script>console.error('deliberate');missing_function();</script>"
    browser.open("data:text/html;base64," + base64.b64encode(page.encode()).decode())
    errors = browser.console_errors()
    assert any("deliberate" in e for e in errors)
    assert any("missing_function" in e for e in errors), errors


def test_report_loads_sorts_and_draws(browser: Browser, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    page = tmp_path / "report.html"
    page.write_text(render(_convert_result()), encoding="utf-8")
    browser.open(page.as_uri())
    assert browser.console_errors() == []

    # Findings: listed most severe first; severity sorts by rank (info < warning < error),
    # not alphabetically.
    assert _column(browser, "findings", 0) == ["error", "warning", "info"]
    browser.click("#table-findings th:nth-child(1)")
    assert _column(browser, "findings", 0) == ["info", "warning", "error"]
    assert browser.evaluate("document.querySelector('#table-findings th').getAttribute('aria-sort')") == "ascending"
    browser.click("#table-findings th:nth-child(1)")
    assert _column(browser, "findings", 0) == ["error", "warning", "info"]

    # Errors: rel_l2 sorts numerically (its text mixes 1.000e-06 and 0.15).
    heads = browser.evaluate("Array.from(document.querySelectorAll('#table-errors th')).map(function(h){return h.textContent;})")
    col = heads.index("rel_l2")
    before = _column(browser, "errors", col)
    browser.click(f"#table-errors th:nth-child({col + 1})")
    after = _column(browser, "errors", col)
    assert after != before
    assert [float(v) for v in after] == sorted(float(v) for v in before)
    assert browser.evaluate("document.querySelector('#table-errors tr.first-divergent').cells[1].textContent") == "e"

    for chart in ("#headroom-chart svg", "#error-chart svg"):
        share, colours, red = _non_white_share(browser.screenshot(chart))
        assert share > 0.03, f"{chart} looks blank ({share:.1%} non-white)"
        assert colours > 20
        # The red FP16 limit line (headroom) and the red first-divergent marker (error) are drawn.
        assert red > 200, f"{chart}: {red} red pixels"
    assert browser.console_errors() == []


def test_report_without_charts_still_sorts(browser: Browser, tmp_path: Path) -> None:
    page = tmp_path / "tables.html"
    page.write_text(render(_convert_result(), plots=False), encoding="utf-8")
    browser.open(page.as_uri())
    assert browser.evaluate("document.querySelectorAll('svg').length") == 0
    browser.click("#table-actions th:nth-child(2)")
    assert _column(browser, "actions", 1) == ["pin_fp32", "rescale"]
    assert browser.console_errors() == []
