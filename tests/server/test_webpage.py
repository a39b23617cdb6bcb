"""The web page at `/` in headless Chromium (Debian's `chromium`, driven by Playwright; no browser is
downloaded): type a prompt, press Generate, see the progress bar move and the image appear. The
screenshot goes to out/webpage.png (git-ignored); its path is printed."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from xstage_dit.server.app import create_app
from xstage_dit.server.config import ServerConfig
from tests.helpers.server import live_server, one_torch_thread, start_worker

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("XSTAGE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    with one_torch_thread():
        yield


# Records every value the page gives its progress bar (the steps can be faster than any polling).
RECORD_PROGRESS = """
const desc = Object.getOwnPropertyDescriptor(HTMLProgressElement.prototype, 'value');
window.__progress = [];
Object.defineProperty(HTMLProgressElement.prototype, 'value', {
  configurable: true,
  get() { return desc.get.call(this); },
  set(v) { window.__progress.push([Number(v), this.max]); desc.set.call(this, v); },
});
"""


def _browser(playwright, user_data_dir: str):
    context = playwright.chromium.launch_persistent_context(
        user_data_dir, executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS,
        viewport={"width": 900, "height": 900})
    context.add_init_script(RECORD_PROGRESS)
    return context


@contextlib.contextmanager
def _open_page(worker, wait_model_js: str):
    """A live server over `worker` and Chromium on its page once the model name shows; yields the page.
    Page errors are collected and asserted empty on exit; the worker is stopped either way."""
    try:
        sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
        with live_server(create_app(worker)) as url, sync_api.sync_playwright() as pw, \
                tempfile.TemporaryDirectory() as profile:
            context = _browser(pw, profile)
            page = context.pages[0] if context.pages else context.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(url + "/")
            page.wait_for_function(wait_model_js)
            yield page
            context.close()
        assert not errors, errors
    finally:
        worker.stop()


def _assert_bar_moved(page, steps: int) -> None:
    values = [v for v, top in page.evaluate("window.__progress") if top == steps]
    assert any(0 < v < steps for v in values), f"the bar never showed a step in between: {values}"
    assert values == sorted(values) and values[-1] == steps, values


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (apt-get install chromium; .ci/run does it)")
def test_page_generates_an_image_with_a_moving_progress_bar():
    worker = start_worker(ServerConfig(max_batch_size=1, api_key=None))
    shot = ROOT / "out" / "webpage.png"
    shot.parent.mkdir(exist_ok=True)
    with _open_page(worker, "document.getElementById('model').textContent.includes('tiny-flux')") as page:
        page.fill("#prompt", "a red cat on a blue sofa")
        page.fill("#width", "128")
        page.fill("#height", "128")
        page.fill("#steps", "30")
        page.fill("#seed", "5")
        page.click("#generate")
        page.wait_for_selector("#output", timeout=60_000)
        _assert_bar_moved(page, 30)  # per step, not only at the end
        page.wait_for_function("document.getElementById('output').naturalWidth === 128")
        assert page.eval_on_selector("#progress", "p => p.value === p.max && p.max === 30")
        assert "done in" in page.text_content("#status")
        page.screenshot(path=str(shot), full_page=True)
    print(f"\nweb page screenshot: {shot}")
    assert shot.stat().st_size > 10_000


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (apt-get install chromium; .ci/run does it)")
def test_page_generates_a_video():
    worker = start_worker(ServerConfig(max_batch_size=1, api_key=None), model="tiny-wan")
    shot = ROOT / "out" / "webpage-video.png"
    shot.parent.mkdir(exist_ok=True)
    with _open_page(worker, "document.getElementById('model').textContent.includes('tiny-wan (video)')") as page:
        assert page.is_visible("#frames")
        page.fill("#prompt", "a cat walking on grass")
        page.fill("#width", "64")
        page.fill("#height", "64")
        page.fill("#frames", "5")
        page.fill("#steps", "3")
        page.click("#generate")
        page.wait_for_selector("video#output", timeout=60_000)
        # The MP4 came through /v1/videos/{id}/content and the browser decoded its first frame.
        page.wait_for_function("document.getElementById('output').readyState >= 2 && "
                               "document.getElementById('output').videoWidth === 64", timeout=30_000)
        # A job this short may finish before the page subscribes to its events: only the end is certain.
        assert page.eval_on_selector("#progress", "p => p.value === p.max && p.max === 3")
        page.screenshot(path=str(shot), full_page=True)
    print(f"\nweb page (video) screenshot: {shot}")
