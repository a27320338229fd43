"""Headless Chromium for the dashboard's browser tests: Debian's package, driven by Playwright.

Playwright's own browser download cannot be fetched here, so the system Chromium is used
(`apt-get install -y chromium`; .ci/run installs it). Without it a test skips, except under CI,
where it fails: the browser test must run there.

One Chromium serves every test of a session: started at the first page, it is reached over the
DevTools protocol (``connect_over_cdp``) and each test gets a browser context of its own (its
cookies, storage and pages; closed at its end), so no test sees another's state. A launch and
close per test cost about 1 s of a 2.5 s page set-up on 2 loaded cores (Playwright's driver, the
rest, still starts per test: its connection belongs to the test's event loop).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.waiting import until

# Flags that keep Chromium off the network and quiet in a container (no sandbox: CI runs as root).
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

# What Playwright's launch() adds to those (playwright-core's chromiumSwitches.ts and its headless
# switches, Playwright 1.65): the session's Chromium is started by us, and must behave as a launched
# one (no timer throttling of a background page, no back-forward cache, no paint holding, ...).
_PLAYWRIGHT_DISABLED_FEATURES = (
    "AvoidUnnecessaryBeforeUnloadCheckSync,DestroyProfileOnBrowserClose,HttpsUpgrades,"
    "HttpsFirstBalancedModeAutoEnable,LensOverlay,MediaRouter,PaintHolding,ThirdPartyStoragePartitioning,"
    "AvoidCorsURLLoaderRestartOnRedirect,TcpPortRandomizationWin,OptimizationHints,NetworkTimeServiceQuerying,"
    "AimEnabled,PreconnectToSearch"
)
PLAYWRIGHT_SWITCHES = [
    "--disable-field-trial-config",
    "--disable-background-timer-throttling",
    "--disable-backgrounding-occluded-windows",
    "--disable-back-forward-cache",
    "--disable-breakpad",
    "--disable-component-extensions-with-background-pages",
    "--no-default-browser-check",
    "--disable-default-apps",
    "--disable-dev-shm-usage",
    "--disable-extensions",
    f"--disable-features={_PLAYWRIGHT_DISABLED_FEATURES}",
    "--enable-features=CDPScreenshotNewSurface,SkipListAccountsWithoutGaiaCookies",
    "--allow-pre-commit-input",
    "--disable-hang-monitor",
    "--disable-ipc-flooding-protection",
    "--disable-popup-blocking",
    "--disable-prompt-on-repost",
    "--disable-renderer-backgrounding",
    "--force-color-profile=srgb",
    "--metrics-recording-only",
    "--password-store=basic",
    "--use-mock-keychain",
    "--no-service-autorun",
    "--disable-search-engine-choice-screen",
    "--unsafely-disable-devtools-self-xss-warnings",
    "--enable-unsafe-swiftshader",
    "--disable-stack-profiler",
    "--disable-infobars",
    "--hide-scrollbars",
    "--mute-audio",
    "--blink-settings=primaryHoverType=2,availableHoverTypes=2,primaryPointerType=4,availablePointerTypes=4",
]


def chromium_path() -> str:
    """The Chromium executable; skips the test (fails it under CI) when there is none."""
    path = os.environ.get("FLEETWIRE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(path).exists():
        why = f"no Chromium at {path}: install Debian's package (apt-get install -y chromium); .ci/run does"
        if os.environ.get("CI"):
            pytest.fail(why)  # CI must run the browser test, never skip it
        pytest.skip(why)
    return path


def _written(port_file: Path) -> bool:
    """Chromium wrote its DevTools port file (the port, then the browser's path on the next line)."""
    with contextlib.suppress(OSError):
        return "\n" in port_file.read_text()
    return False


class _SharedChromium:
    """The session's Chromium process, listening for DevTools on a port of 127.0.0.1 it picks."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.profile = ""
        self.endpoint = ""

    async def url(self, executable: str) -> str:
        """The DevTools endpoint (``http://127.0.0.1:PORT``), starting Chromium first if it is not running."""
        if self.proc is None or self.proc.poll() is not None:
            proc, port_file = self._start(executable)
            await until(lambda: _written(port_file) or proc.poll() is not None, timeout_s=60, interval_s=0.02)
            self.endpoint = self._endpoint(port_file)
        return self.endpoint

    def _start(self, executable: str) -> tuple[subprocess.Popen[bytes], Path]:
        self.stop()
        self.profile = tempfile.mkdtemp(prefix="fleetwire-chromium-")
        with open(os.path.join(self.profile, "stderr.log"), "wb") as log:
            self.proc = subprocess.Popen(
                [executable, *CHROMIUM_FLAGS, *PLAYWRIGHT_SWITCHES, "--remote-debugging-address=127.0.0.1",
                 "--remote-debugging-port=0",
                 f"--user-data-dir={self.profile}", "about:blank"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
            )  # fmt: skip
        return self.proc, Path(self.profile) / "DevToolsActivePort"  # Chromium writes its port there

    def _endpoint(self, port_file: Path) -> str:
        if not _written(port_file):
            log = (Path(self.profile) / "stderr.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"Chromium exited ({self.proc and self.proc.returncode}) before listening: {log}")
        return f"http://127.0.0.1:{port_file.read_text().splitlines()[0].strip()}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self.profile:
            shutil.rmtree(self.profile, ignore_errors=True)
            self.profile = ""


_chromium = _SharedChromium()
atexit.register(_chromium.stop)


@asynccontextmanager
async def browser_page(width: int, height: int) -> AsyncIterator[Any]:
    """A page of that viewport in a fresh browser context of the session's headless Chromium; the context
    is closed on exit."""
    executable = chromium_path()
    playwright = pytest.importorskip("playwright.async_api", reason="pip install playwright (in the test extra)")
    endpoint = await _chromium.url(executable)
    async with playwright.async_playwright() as pw:
        browser = await pw.chromium.connect_over_cdp(endpoint)
        try:
            context = await browser.new_context(viewport={"width": width, "height": height})
            try:
                yield await context.new_page()
            finally:
                with contextlib.suppress(Exception):  # Chromium may be gone: the test's own error says why
                    await context.close()
        finally:
            await browser.close()  # over CDP: disconnects, Chromium keeps running for the next test
