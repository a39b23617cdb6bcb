"""The web page at `/` in headless Chromium (Debian's `chromium`, driven by Playwright; no browser is
downloaded): type a prompt, press Generate, see the progress bar move and the image appear; the
random-weights notice; a server with an API key (asked for, 401 shown, then accepted); an error after
an image (the old image goes); an empty Steps field (the model's default); an uploaded image edited (FLUX.1
Kontext) or animated (Wan I2V), shown beside the output. Screenshots go to out/ (git-ignored: webpage.png,
webpage-apikey.png, webpage-error.png, webpage-video.png, webpage-edit.png, webpage-image-to-video.png); their
paths are printed. docs/webpage.png, shown in the README, is a copy of out/webpage.png."""

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
        _wait_for_output(page)
        _assert_bar_moved(page, 30)  # per step, not only at the end
        page.wait_for_function("document.getElementById('output').naturalWidth === 128")
        assert page.eval_on_selector("#progress", "p => p.value === p.max && p.max === 30")
        assert "done in" in page.text_content("#status")
        # Built-in model: the page says its weights are random and how to use real ones.
        assert page.is_visible("#notice") and "--model /path/to/" in page.text_content("#notice")
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


def _wait_for_output(page, timeout_ms: int = 60_000) -> None:
    """Wait for the page's #output; on a timeout, fail saying what the page showed (its status and model lines),
    which a bare Playwright timeout does not (one CI run, 2026-12-07, timed out here with nothing to read)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_selector("#output", timeout=timeout_ms)
    except PlaywrightTimeout:
        status, model = page.text_content("#status"), page.text_content("#model")
        shot = _shot(page, "webpage-timeout.png")
        pytest.fail(f"no #output within {timeout_ms / 1000:.0f} s: status {status!r}, model {model!r} ({shot})")


def _shot(page, name: str) -> Path:
    shot = ROOT / "out" / name
    shot.parent.mkdir(exist_ok=True)
    page.screenshot(path=str(shot), full_page=True)
    print(f"\nweb page screenshot: {shot}")
    return shot


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (apt-get install chromium; .ci/run does it)")
def test_page_with_an_api_key_asks_for_it_shows_the_401_then_works():
    worker = start_worker(ServerConfig(max_batch_size=1, api_key="page-key"))
    with _open_page(worker, "document.getElementById('model').textContent.includes('API key')") as page:
        assert "needs an API key" in page.text_content("#model")
        page.fill("#prompt", "a red cat on a blue sofa")
        page.click("#generate")  # no key yet: an error is shown, not nothing
        page.wait_for_function("document.getElementById('status').className === 'error'")
        assert "API key" in page.text_content("#status")
        _shot(page, "webpage-apikey.png")
        page.fill("#apikey", "wrong-key")
        page.click("#generate")
        page.wait_for_function("document.getElementById('model').textContent.includes('refused')")
        page.fill("#apikey", "page-key")
        page.click("#generate")
        _wait_for_output(page)
        assert page.text_content("#model").startswith("model tiny-flux") and "done in" in page.text_content("#status")


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (apt-get install chromium; .ci/run does it)")
def test_page_error_after_an_image_clears_it_and_empty_steps_mean_the_default():
    worker = start_worker(ServerConfig(max_batch_size=1, api_key=None))
    default_steps = worker.served.default_steps
    with _open_page(worker, "document.getElementById('model').textContent.includes('tiny-flux')") as page:
        page.fill("#prompt", "a red cat on a blue sofa")
        page.fill("#width", "64")
        page.fill("#height", "64")
        page.fill("#steps", "")  # left empty: the model's default, not 0
        page.click("#generate")
        _wait_for_output(page)
        assert page.eval_on_selector("#progress", f"p => p.max === {default_steps} && p.value === p.max")
        page.fill("#width", "4096")  # past the server's max_size: refused by the server, not the browser
        page.click("#generate")
        page.wait_for_function("document.getElementById('status').className === 'error'")
        assert "size: expected width in [16, 2048], got 4096" in page.text_content("#status")
        assert page.query_selector("#output") is None  # the previous image does not sit under the error
        _shot(page, "webpage-error.png")


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (apt-get install chromium; .ci/run does it)")
def test_api_docs_render_without_internet():
    # This machine reaches no CDN: Swagger UI draws the operations only from the server's own files.
    worker = start_worker(ServerConfig(max_batch_size=1, api_key=None))
    with _open_page(worker, "document.getElementById('model').textContent.includes('tiny-flux')") as page:
        page.goto(page.url.rstrip("/") + "/docs")
        page.wait_for_selector(".opblock-summary-path", timeout=30_000)
        paths = page.eval_on_selector_all(".opblock-summary-path", "els => els.map(e => e.textContent)")
        assert "/v1/images/generations" in "".join(paths), paths
        _shot(page, "webpage-docs.png")


def _input_png(tmp_path: Path, width: int, height: int) -> Path:
    from tests.helpers.family_harness import seeded_image

    path = tmp_path / f"input-{width}x{height}.png"
    seeded_image(21, width, height).save(path)
    return path


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (apt-get install chromium; .ci/run does it)")
def test_page_edits_an_uploaded_image_and_shows_it_beside_the_output(tmp_path):
    import base64

    import httpx

    worker = start_worker(ServerConfig(max_batch_size=1, api_key=None), model="tiny-flux-kontext")
    image = _input_png(tmp_path, 96, 64)
    with _open_page(worker, "document.getElementById('model').textContent.includes('tiny-flux-kontext')") as page:
        assert page.is_visible("#image") and not page.is_visible("#mask")  # Kontext takes an image, no mask
        page.set_input_files("#image", str(image))
        page.wait_for_function("document.getElementById('width').value === '96'")  # the edit's size: the input's
        assert page.input_value("#height") == "64"
        page.fill("#prompt", "make it snow")
        page.fill("#steps", "2")
        page.fill("#seed", "5")
        page.click("#generate")
        _wait_for_output(page)
        page.wait_for_function("document.getElementById('output').naturalWidth === 96")
        page.wait_for_function("document.getElementById('input-preview').naturalWidth === 96")
        captions = page.eval_on_selector_all("#result figcaption", "els => els.map(e => e.textContent)")
        assert captions == ["input", "output"]
        shown = page.get_attribute("#output", "src").split(",", 1)[1]
        url = page.url.rstrip("/")
        _shot(page, "webpage-edit.png")
    # the page's edit is the server's edit of that file (not a text-to-image of the prompt)
    worker = start_worker(ServerConfig(max_batch_size=1, api_key=None), model="tiny-flux-kontext")
    try:
        with live_server(create_app(worker)) as url, httpx.Client(base_url=url, timeout=120) as client:
            direct = client.post("/v1/images/edits", files={"image": ("in.png", image.read_bytes(), "image/png")},
                                 data={"prompt": "make it snow", "num_inference_steps": "2", "seed": "5",
                                       "size": "96x64"})
    finally:
        worker.stop()
    assert direct.status_code == 200 and base64.b64decode(direct.json()["data"][0]["b64_json"]) == \
        base64.b64decode(shown)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (apt-get install chromium; .ci/run does it)")
def test_page_animates_an_uploaded_image(tmp_path):
    worker = start_worker(ServerConfig(max_batch_size=1, api_key=None), model="tiny-wan-i2v")
    with _open_page(worker, "document.getElementById('model').textContent.includes('tiny-wan-i2v (video)')") as page:
        assert page.is_visible("#image") and page.is_visible("#frames")
        page.set_input_files("#image", str(_input_png(tmp_path, 80, 60)))
        page.fill("#prompt", "the fox runs")
        page.fill("#width", "64")
        page.fill("#height", "48")
        page.fill("#frames", "5")
        page.fill("#steps", "2")
        page.click("#generate")
        page.wait_for_selector("video#output", timeout=60_000)
        page.wait_for_function("document.getElementById('output').readyState >= 2 && "
                               "document.getElementById('output').videoWidth === 64", timeout=30_000)
        assert page.eval_on_selector("#input-preview", "img => img.naturalWidth") == 80
        _shot(page, "webpage-image-to-video.png")
