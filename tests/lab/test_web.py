"""The web console in a real browser (Debian's headless Chromium through Selenium) against the lab:
log in, migrate a counter VM and watch its progress reach done while the console keeps counting,
then cancel a second migration and see the VM stay. Screenshots go to tests/artifacts/."""

import os
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.expected_conditions import staleness_of
from selenium.webdriver.support.ui import Select, WebDriverWait

from vmmgr.lab_services import FLOWER_PORT
from vmmgr.state import FleetState
from vmmgr.users import Users

from tests.conftest import free_port, wait_for_port

from .conftest import VMMGR, assert_contiguous, cli, ticks, where_defined

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
USER, PASSWORD = "web-test-operator", "a long test password"
TERMINAL_TEXT = """
const b = window.vmmgrTerm.buffer.active, lines = [];
for (let i = 0; i < b.length; i++) lines.push(b.getLine(i).translateToString(true));
return lines.join("\\n");
"""


@pytest.fixture
def console_url(lab, paths):
    """`vmmgr web` serving the lab, with an operator account; both gone afterwards."""
    users = Users(paths.users)
    users.add(USER, PASSWORD, "operator", replace=True)
    port = free_port()
    server = subprocess.Popen([VMMGR, "web", "--port", str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for_port(server, port, 30, "vmmgr web")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(10)
        users.remove(USER)


@pytest.fixture
def browser(request):
    for tool in ("chromium", "chromedriver"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is missing: `./run setup` installs Debian's chromium packages")
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                "--window-size=1400,1000", f"--user-data-dir=/tmp/vmmgr-chromium-{os.getpid()}"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    ARTIFACTS.mkdir(exist_ok=True)
    try:
        yield driver
        if getattr(request.node, "report_call", None) is None or request.node.report_call.failed:
            driver.save_screenshot(str(ARTIFACTS / "web-failure.png"))  # what the browser showed
            (ARTIFACTS / "web-failure.html").write_text(driver.page_source)
    finally:
        driver.quit()
        shutil.rmtree(f"/tmp/vmmgr-chromium-{os.getpid()}", ignore_errors=True)


def until(what, timeout: float, message: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(message)


def text(driver, element_id: str) -> str:
    found = driver.find_elements(By.ID, element_id)
    if not found:  # say which page the browser is on, and what it says, instead of a bare miss
        said = " | ".join(e.text for e in driver.find_elements(By.CSS_SELECTOR, "h1, .flash"))
        raise AssertionError(f"no #{element_id} on {driver.current_url}: {said}")
    return found[0].text


def terminal_ticks(driver) -> list[int]:
    return [int(n) for n in re.findall(r"^tick (\d+)$", driver.execute_script(TERMINAL_TEXT),
                                       re.M)]


def click_and_read_flash(driver, button_id: str) -> str:
    """Post a form and return the message the next page shows at its top."""
    page = driver.find_element(By.TAG_NAME, "html")
    driver.find_element(By.ID, button_id).click()
    WebDriverWait(driver, 10).until(staleness_of(page))
    return until(lambda: driver.find_elements(By.CSS_SELECTOR, ".flash"), 10,
                 "no message after the form post")[0].text


def migrate_from_page(driver, target: str, bandwidth: int) -> None:
    Select(driver.find_element(By.ID, "target")).select_by_value(target)
    driver.find_element(By.ID, "bandwidth").send_keys(str(bandwidth))
    assert "migrate queued" in click_and_read_flash(driver, "migrate")


def test_migrate_watch_and_cancel_in_a_browser(console_url, browser, make_vm, fleet, paths):
    make_vm("web1", host="host1")
    d = browser
    d.get(console_url + "/vms/web1")
    assert "/login" in d.current_url  # nothing without logging in
    d.find_element(By.NAME, "name").send_keys(USER)
    d.find_element(By.NAME, "password").send_keys(PASSWORD)
    d.find_element(By.ID, "login").click()
    until(lambda: d.current_url.endswith("/vms/web1"), 10, "login did not lead back to the VM")

    d.get(console_url + "/")
    until(lambda: "web1" in d.find_element(By.ID, "host-host1").text, 10, "fleet page lacks web1")
    d.save_screenshot(str(ARTIFACTS / "web-fleet.png"))

    d.get(console_url + "/vms/web1")
    until(lambda: len(terminal_ticks(d)) >= 5, 60, "the console shows no ticks")
    # A target without room is listed with its reason; host1 is where the VM runs.
    assert "host1: the VM runs here" in text(d, "targets")

    # 1. Migrate to host2 at 20 MiB/s: progress shows up live, then reaches done.
    migrate_from_page(d, "host2", 20)
    until(lambda: text(d, "op-state") == "running" and text(d, "p-iteration") not in ("-", "0")
          and text(d, "p-processed") != "-", 60, "no live progress appeared")
    for field in ("p-remaining", "p-speed", "p-dirty", "p-limit"):
        assert text(d, field) != "-", field
    d.save_screenshot(str(ARTIFACTS / "web-migration-progress.png"))
    until(lambda: text(d, "op-state") == "done", 120, "the migration never reached done")
    assert text(d, "op-result").startswith("done: host1 → host2")
    until(lambda: text(d, "vm-host") == "host2", 10, "the page did not show the new host")
    assert "completed" in text(d, "history")
    assert where_defined(fleet, "web1") == ["host2"]

    # The console keeps counting in the same terminal, with no gap and no repeat across the move.
    before = terminal_ticks(d)
    until(lambda: len(terminal_ticks(d)) >= len(before) + 5, 30, "the console stopped counting")
    assert_contiguous(ticks(paths, "web1"))  # what the VM wrote...
    assert_contiguous(terminal_ticks(d))  # ...and what the browser shows

    # 2. A slow migration (2 MiB/s) to host3, cancelled from the page: the VM stays on host2.
    migrate_from_page(d, "host3", 2)
    until(lambda: text(d, "op-state") == "running" and text(d, "p-processed") != "-", 60,
          "the second migration shows no progress")
    until(lambda: d.find_element(By.ID, "cancel").is_enabled(), 10, "Cancel is not offered")
    assert "cancel queued" in click_and_read_flash(d, "cancel")
    until(lambda: text(d, "op-state") == "failed", 60, "the cancelled migration did not end")
    assert "cancel" in text(d, "op-result")
    until(lambda: "failed" in text(d, "history"), 10, "the history lacks the cancelled attempt")
    assert text(d, "vm-host") == "host2"
    assert where_defined(fleet, "web1") == ["host2"]
    assert fleet.locate("web1").state() == "running"
    d.save_screenshot(str(ARTIFACTS / "web-cancelled.png"))


def test_flower_lists_a_task_the_test_ran(lab, browser, paths):
    """Flower, which the lab runs on the control node's loopback as the control role's unit
    does, opens in the browser and lists a task this test ran through the task API."""
    cli("host", "enable", "host3", check_code=0)
    state = FleetState(paths.redis_url())
    task = next(t["id"] for t in state.recent_tasks(50) if t.get("name") == "enable_host")
    flower = f"http://127.0.0.1:{FLOWER_PORT}"
    d = browser
    until(lambda: _answers(flower), 30, "Flower does not answer")
    d.get(f"{flower}/tasks")
    until(lambda: task in d.find_element(By.TAG_NAME, "body").text, 30,
          f"Flower's task list lacks {task}")
    d.get(f"{flower}/task/{task}")
    until(lambda: "SUCCESS" in d.find_element(By.TAG_NAME, "body").text, 30,
          f"Flower's page of {task} does not say SUCCESS")
    assert "vmmgr.enable_host" in d.find_element(By.TAG_NAME, "body").text
    d.save_screenshot(str(ARTIFACTS / "flower-task.png"))


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/healthcheck", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False
