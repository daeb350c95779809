"""Open a page in a real headless Chromium (Debian's package, driven by playwright), collecting
console errors, page errors and failed requests: the HTML reports' render checks share it.
Skips without Chromium, unless PDC_REQUIRE_CHROMIUM=1 (CI), which fails instead."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@contextmanager
def chromium_page(path: Path, viewport: dict | None = None) -> Iterator[tuple[object, list[str]]]:
    """(the loaded page, its errors so far): assert the errors list is empty after looking."""
    if not CHROMIUM.exists():
        if os.environ.get("PDC_REQUIRE_CHROMIUM") == "1":
            pytest.fail(f"{CHROMIUM} is missing and PDC_REQUIRE_CHROMIUM=1")
        pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium); set PDC_REQUIRE_CHROMIUM=1 to fail")
    if os.environ.get("PDC_REQUIRE_CHROMIUM") == "1":
        from playwright import sync_api
    else:
        sync_api = pytest.importorskip("playwright.sync_api")
    errors: list[str] = []
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=viewport or {"width": 1280, "height": 900})
            page.on("console", lambda m: errors.append(f"console: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
            page.on("requestfailed", lambda r: errors.append(f"request failed: {r.url}"))
            page.goto(path.as_uri(), wait_until="load")
            yield page, errors
        finally:
            browser.close()
