"""A real headless Chromium for page tests: Debian's ``chromium`` driven by Selenium through Debian's ``chromedriver``.

Nothing is downloaded: Selenium is given both binaries' paths, so its driver
manager never runs. ``tools/test`` installs the two packages where apt-get
works as root; elsewhere the tests that need them skip and say why, except
under CI (``CI`` set), where a missing browser fails them.
"""

from __future__ import annotations

import os
import shutil

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


def need_browser() -> None:
    """Skip (fail under CI) unless Chromium and its driver are installed."""
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not shutil.which(path)]
    if not missing:
        return
    reason = (f"LOUD SKIP: {', '.join(missing)} missing: install Debian's chromium and chromium-driver "
              "(tools/test does so with apt-get as root)")
    if os.environ.get("CI"):
        pytest.fail(reason.replace("LOUD SKIP", "CI must have a browser"))
    pytest.skip(reason)


def chromium(width: int = 1360, height: int = 1100):  # type: ignore[no-untyped-def]
    """A new headless Chromium session (the caller quits it)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     f"--window-size={width},{height}", "--disable-extensions", "--no-first-run"):
        options.add_argument(argument)
    return webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
