"""Headless Chromium for the dashboard's browser tests: Debian's package, driven by Playwright.

Playwright's own browser download cannot be fetched here, so the system Chromium is used
(`apt-get install -y chromium`; .ci/run installs it). Without it a test skips, except under CI,
where it fails: the browser test must run there.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

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


def chromium_path() -> str:
    """The Chromium executable; skips the test (fails it under CI) when there is none."""
    path = os.environ.get("FLEETWIRE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(path).exists():
        why = f"no Chromium at {path}: install Debian's package (apt-get install -y chromium); .ci/run does"
        if os.environ.get("CI"):
            pytest.fail(why)  # CI must run the browser test, never skip it
        pytest.skip(why)
    return path


@asynccontextmanager
async def browser_page(width: int, height: int) -> AsyncIterator[Any]:
    """A page of that viewport in headless Chromium; the browser is closed on exit."""
    executable = chromium_path()
    playwright = pytest.importorskip("playwright.async_api", reason="pip install playwright (in the test extra)")
    async with playwright.async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_FLAGS)
        try:
            context = await browser.new_context(viewport={"width": width, "height": height})
            yield await context.new_page()
        finally:
            await browser.close()
