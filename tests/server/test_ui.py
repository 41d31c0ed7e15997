"""The web playground and dashboard (server/ui.py, server/static/index.html), in a real headless Chromium (Debian's
`chromium`, driven by Playwright; `make test` installs it): the key prompt, a streamed chat answer, stopping a long
one, the dashboard's numbers moving, model text rendered as text; and the routes over plain HTTP.

TOKENMILL_SCREENSHOTS=docs writes the README's screenshots there."""

from __future__ import annotations

import os
import re
import shutil
import time

import httpx
import pytest

from tests.server.conftest import API_KEY, start_server

pytestmark = pytest.mark.slow
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def keyed():
    s = start_server()
    try:
        yield s
    finally:
        s.stop()


def test_the_page_ships_every_asset_and_the_stats_need_the_key(keyed):
    page = httpx.get(keyed.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert not re.search(r"""(src|href)=["']https?://""", page.text)  # no CDN: works offline
    assert httpx.get(keyed.url + "/ui/stats").status_code == 401
    stats = httpx.get(keyed.url + "/ui/stats", headers=keyed.headers).json()
    for field in ("running", "waiting", "kv_usage", "prefix_cache_hit_rate", "prompt_tokens_total",
                  "generation_tokens_total", "ttft_ms", "itl_ms", "preemptions_total", "rejected_total"):
        assert field in stats


def test_no_ui_turns_the_page_off():
    s = start_server("--no-ui", api_key=None)
    try:
        assert httpx.get(s.url + "/").status_code == 404 and httpx.get(s.url + "/ui/stats").status_code == 404
        assert httpx.get(s.url + "/health").status_code == 200
    finally:
        s.stop()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    assert CHROMIUM, "chromium is not installed: `make browser` installs it"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


def shot(page, name: str) -> None:
    where = os.environ.get("TOKENMILL_SCREENSHOTS")
    if where:
        page.screenshot(path=os.path.join(where, name), full_page=True)


def stats(server) -> dict:
    return httpx.get(server.url + "/ui/stats", headers=server.headers).json()


def test_chat_streams_an_answer_stops_a_long_one_and_the_dashboard_moves(keyed, browser):
    page = browser.new_page(viewport={"width": 1100, "height": 800}, bypass_csp=True)  # lets the test evaluate JS
    page.goto(keyed.url + "/")
    page.wait_for_selector("#keybox", state="visible")  # the server has a key: the page asks for it
    page.fill("#key", API_KEY)
    page.click("#key-save")
    page.wait_for_function("document.querySelector('#model').options.length > 0")
    before = stats(keyed)["generation_tokens_total"]

    page.fill("#temperature", "0")
    page.fill("#max_tokens", "48")
    page.fill("#input", "Name three colours.")
    page.click("#send")
    body = page.locator(".msg.assistant .body").last
    lengths = []
    deadline = time.monotonic() + 60
    while not page.locator(".msg.assistant .stats").last.inner_text() and time.monotonic() < deadline:
        lengths.append(len(body.inner_text()))
        time.sleep(0.05)
    assert page.locator(".msg.assistant .stats").last.inner_text().count("output tokens") == 1
    growing = sorted({n for n in lengths if n})
    assert len(growing) >= 3, lengths  # the answer appeared piece by piece, not at once
    shot(page, "playground.png")

    page.fill("#max_tokens", "4000")
    page.fill("#input", "Write a very long story about the sea.")
    page.click("#send")
    page.wait_for_function("document.querySelectorAll('.msg.assistant .body')[1].innerText.length > 20")
    assert stats(keyed)["running"] >= 1
    page.click("#send")  # now "Stop": aborts the request
    deadline = time.monotonic() + 20
    while stats(keyed)["running"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stats(keyed)["running"] == 0  # the server aborted it
    assert "output tokens" in page.locator(".msg.assistant .stats").last.inner_text()

    page.click("nav button[data-tab=dash]")
    page.wait_for_function("document.getElementById('v-out').textContent !== '–'")
    time.sleep(1.5)
    assert stats(keyed)["generation_tokens_total"] > before
    assert page.locator("#v-ttft50").inner_text() not in ("", "–")  # latency percentiles from the requests above
    shot(page, "dashboard.png")
    page.close()


def test_model_text_is_rendered_as_text_never_as_html(keyed, browser):
    page = browser.new_page(bypass_csp=True)
    page.goto(keyed.url + "/")
    evil = "<script>window.pwned = 1</script><img src=x onerror=\"window.pwned = 2\"> **bold** `code`"
    page.evaluate("(text) => addMessage('assistant', text)", evil)
    time.sleep(0.3)
    assert page.evaluate("window.pwned") is None
    body = page.locator(".msg.assistant .body").last
    assert "<script>window.pwned = 1</script>" in body.inner_text()
    assert body.locator("b").inner_text() == "bold" and body.locator("code").inner_text() == "code"
    assert page.evaluate("renderMarkdown('```py\\n<b>x</b>\\n```')") == "<pre><code>&lt;b&gt;x&lt;/b&gt;\n</code></pre>"
    page.close()
