"""The page at / in a real headless Chromium: type a prompt, send, and read each token's origin from the DOM."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'hfspec[serve]'")
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed: pip install 'hfspec[test]'")

CHROMIUM, DRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
if not (CHROMIUM.exists() and DRIVER.exists()):
    pytest.skip(
        "no headless Chromium: apt-get install -y chromium chromium-driver (Debian's packages, which .ci/run installs)",
        allow_module_level=True,
    )

import tiny  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402
from serve_fakes import FakeEngine, running_server  # noqa: E402

from hfspec.serve.app import create_app  # noqa: E402

FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
)


@pytest.fixture
def browser(monkeypatch):
    monkeypatch.setenv("SE_OFFLINE", "true")  # Selenium Manager must not download a driver
    monkeypatch.setenv("SE_AVOID_STATS", "true")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in FLAGS:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(DRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def test_the_page_streams_an_answer_coloured_by_origin(browser):
    engine = FakeEngine(step_seconds=0.02)
    with running_server(create_app(engine, tiny.make_tokenizer(64)), engine) as url:
        browser.get(url + "/")
        wait = WebDriverWait(browser, 20)
        wait.until(lambda d: d.find_element(By.ID, "model").text == "fake-model")
        prompt = browser.find_element(By.ID, "prompt")
        prompt.clear()
        prompt.send_keys("w10 w11")
        tokens = browser.find_element(By.ID, "max-tokens")
        tokens.clear()
        tokens.send_keys("6")
        browser.find_element(By.ID, "send").click()
        wait.until(lambda d: d.find_element(By.ID, "answer").get_attribute("data-state") in ("done", "error"))
        assert browser.find_element(By.ID, "error").text == ""
        spans = browser.find_elements(By.CSS_SELECTOR, "#answer span[data-origin]")
        assert [s.get_attribute("data-origin") for s in spans] == ["accepted", "bonus"] * 3
        assert [int(s.get_attribute("data-token-id")) for s in spans] == list(range(10, 16))
        assert browser.find_element(By.ID, "answer").text == "w10 w11 w12 w13 w14 w15"
        assert browser.find_element(By.ID, "tpp").text == "2.00 tokens per pass"
        assert browser.find_element(By.ID, "tps").text.endswith("tokens/s")
        assert browser.find_element(By.ID, "tps").text != "– tokens/s"
        (request,) = engine.requests
        assert request.max_new_tokens == 6 and request.temperature == 0
