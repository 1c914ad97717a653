"""`ctseg review` in a real browser: headless Chromium (Debian's `chromium` and
`chromium-driver`, which `make install` and CI install) driven by Selenium against the
real command's server over a predicted batch. WebGL2 draws through SwiftShader, Chromium's
software renderer, on machines without a GPU.

On a failure, screenshots of the page are written where the failure says.
"""

import contextlib
import io
import json
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ctseg.review.marks import MARKS_FILE

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
selenium = pytest.importorskip("selenium", reason="the test extra installs selenium")
if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
    pytest.skip("needs Debian's chromium and chromedriver: make install", allow_module_level=True)

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

WAIT_S = 30  # for a page, a scan drawn, a mark saved (each takes about a second here)
TEST_S = 150  # the whole test, past which it fails rather than hang the suite
LIVER, TUMOUR = (230, 80, 60), (255, 215, 0)  # review.js's label colours


@contextlib.contextmanager
def _deadline(seconds: int):
    def expire(*_):
        raise TimeoutError(f"the browser test ran past {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


class Server:
    """`ctseg review FOLDER` in a process of its own, as a user starts it."""

    def __init__(self, folder: Path):
        command = [sys.executable, "-m", "ctseg", "review", str(folder), "--reviewer", "dr. b"]
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.process.stdout.readline()))
        reader.start()
        reader.join(WAIT_S)
        found = re.search(r"http://\S+", line[0]) if line else None
        if found is None:
            self.stop()
            raise AssertionError(f"ctseg review printed no link: {line}")
        self.url = found.group(0)
        self.base = self.url.split("/?")[0]

    def stop(self) -> None:
        """Ctrl-C: the server stops cleanly, as every command does (one line, no traceback;
        the shell's status for the signal, or 0)."""
        if self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            rest, _ = self.process.communicate(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise
        assert self.process.returncode in (0, 128 + signal.SIGINT), rest
        assert "Traceback" not in rest, rest


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=WAIT_S) as answer:
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _browser() -> webdriver.Chrome:
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless", "--enable-unsafe-swiftshader", "--use-angle=swiftshader",
                 "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,800"):  # fmt: skip
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(WAIT_S)
    driver.set_script_timeout(WAIT_S)
    return driver


@contextlib.contextmanager
def _screenshots_on_failure(driver, folder: Path):
    try:
        yield
    except BaseException as exc:
        folder.mkdir(parents=True, exist_ok=True)
        shots = []
        for index, handle in enumerate(driver.window_handles):
            driver.switch_to.window(handle)
            shots.append(folder / f"tab-{index}.png")
            driver.save_screenshot(str(shots[-1]))
        shown = ", ".join(map(str, shots))
        raise AssertionError(f"{exc!r}; screenshots of the page: {shown}") from exc


def _wait(driver, condition, what: str):
    WebDriverWait(driver, WAIT_S, poll_frequency=0.1).until(
        lambda d: condition(d), message=f"waited {WAIT_S} s for {what}"
    )


def _rows(driver) -> list[str]:
    rows = driver.find_elements(By.CSS_SELECTOR, "#cases tbody tr")
    return [row.get_attribute("data-name") for row in rows]


def _open_page(driver, url: str):
    driver.get(url)
    _wait(driver, lambda d: d.execute_script("return document.body.dataset.ready"), "the page")


def _mark_of(driver, name: str) -> str:
    row = driver.find_element(By.CSS_SELECTOR, f'#cases tbody tr[data-name="{name}"]')
    return row.find_elements(By.TAG_NAME, "td")[-1].text


def _canvas_pixels(driver) -> np.ndarray:
    png = driver.find_element(By.ID, "gl").screenshot_as_png
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).reshape(-1, 3).astype(int)


def _has_colour(pixels: np.ndarray, colour: tuple[int, int, int]) -> bool:
    return bool((np.abs(pixels - colour).max(axis=1) <= 12).sum() >= 5)


def test_the_page_shows_the_batch_draws_scans_and_keeps_marks(batch, page_order, tmp_path):
    with _deadline(TEST_S):
        server = Server(batch)
        driver = _browser()
        try:
            with _screenshots_on_failure(driver, tmp_path / "screenshots"):
                _review(driver, server, batch, page_order)
                server.stop()
                server = Server(batch)  # restarted: the marks are read back from the folder
                _open_page(driver, server.url)
                assert _mark_of(driver, "volume-0") == "reject ✎"
                assert _mark_of(driver, "volume-2") == "accept"
        finally:
            driver.quit()
            server.stop()


def _review(driver, server: Server, batch: Path, page_order: list[str]) -> None:
    # Without the token, and for a file no record names: refused.
    assert _status(server.base + "/") == 403
    assert _status(server.base + "/api/batch") == 403
    token = server.url.split("token=")[1]
    assert _status(f"{server.base}/files/volume-1/stats.json?token={token}") == 404
    assert _status(f"{server.base}/files/volume-1/..%2f..%2fx?token={token}") == 404

    _open_page(driver, server.url)
    assert _rows(driver) == page_order
    assert "token" not in driver.current_url  # the token moved to a cookie

    # volume-0 (ok: the last row) has tumours to see; its first tumour's axial slice
    # passes through the liver too.
    driver.find_element(By.CSS_SELECTOR, '#cases tbody tr[data-name="volume-0"]').click()
    drawn = "return document.body.dataset.drawn"
    _wait(driver, lambda d: d.execute_script(drawn) == "volume-0", "volume-0 drawn")
    driver.execute_script(
        "const o = document.getElementById('opacity'); o.value = 1;"
        "o.dispatchEvent(new Event('input'));"
    )
    driver.find_element(By.CSS_SELECTOR, '#layouts button[data-layout="axial"]').click()
    driver.find_element(By.CSS_SELECTOR, "#tumours button").click()
    pixels = _canvas_pixels(driver)
    assert len(np.unique(pixels, axis=0)) > 50, "the canvas is (nearly) uniform"
    assert _has_colour(pixels, LIVER), "no liver colour on the canvas"
    assert _has_colour(pixels, TUMOUR), "no tumour colour on the canvas"

    # The HU and label under the cursor.
    canvas = driver.find_element(By.ID, "gl")
    webdriver.ActionChains(driver).move_to_element(canvas).click().perform()
    assert "HU" in driver.find_element(By.ID, "readout").text

    # A mark with a comment, saved, shown again after a reload.
    driver.find_element(By.ID, "comment").send_keys("left lobe missed")
    driver.find_element(By.CSS_SELECTOR, '#marks button[data-mark="reject"]').click()
    status = driver.find_element(By.ID, "mark-status")
    _wait(driver, lambda d: status.text.startswith("saved"), "the mark saved")
    marks = json.loads((batch / MARKS_FILE).read_text())["marks"]
    assert marks["volume-0"]["mark"] == "reject"
    assert marks["volume-0"]["comment"] == "left lobe missed"
    assert marks["volume-0"]["reviewer"] == "dr. b"

    # Two tabs marking different scans: both marks kept.
    first = driver.current_window_handle
    driver.switch_to.new_window("tab")
    _open_page(driver, server.base + "/")  # the cookie carries the token now
    driver.find_element(By.CSS_SELECTOR, '#cases tbody tr[data-name="volume-2"]').click()
    driver.find_element(By.TAG_NAME, "body").send_keys("a")  # keyboard: accept
    _wait(driver, lambda d: "accept" in json.dumps(_saved(batch)), "the second tab's mark")
    driver.close()
    driver.switch_to.window(first)
    driver.refresh()
    _wait(driver, lambda d: d.execute_script("return document.body.dataset.ready"), "reload")
    driver.find_element(By.ID, "back").click()
    assert _mark_of(driver, "volume-0") == "reject ✎"
    assert _mark_of(driver, "volume-2") == "accept"
    assert set(_saved(batch)) == {"volume-0", "volume-2"}


def _saved(batch: Path) -> dict:
    with contextlib.suppress(FileNotFoundError, ValueError):
        return json.loads((batch / MARKS_FILE).read_text())["marks"]
    return {}
