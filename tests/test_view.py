"""`vlforge view` in a real headless Chromium (the OS package, driven by Selenium): the run list, a
curve's points, the GRPO rollout browser, the eval browser, and the --export file with the network
off. Runs of the tiny model made here; the page is read as the browser rendered it.

VLFORGE_SCREENSHOT=1 saves the README's screenshot (docs/img/view.png); otherwise it goes to tmp."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import yaml
from helpers import tiny_sft_config
from test_samples import shapes_grpo

from vlforge.train.metrics import read_metrics
from vlforge.train.samples import read_samples

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
SCREENSHOT = Path(__file__).parent.parent / "docs" / "img" / "view.png"


@pytest.fixture(scope="module")
def runs(shapes_dir, tmp_path_factory):
    """A GRPO run (4 steps, images, eval) and an SFT run with eval, in one folder."""
    from vlforge.recipes.grpo import run_grpo
    from vlforge.recipes.sft import run_sft

    root = tmp_path_factory.mktemp("runs")
    run_grpo(shapes_grpo(shapes_dir, root / "grpo", root, "log.samples_per_step=2"))
    run_sft(tiny_sft_config(shapes_dir, root / "sft", "eval.every=1", "train.max_steps=3"))
    return root


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium from the OS packages; skipped only where they are absent (CI installs them)."""
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        pytest.skip(f"no {CHROMIUM} / {CHROMEDRIVER}: apt-get install chromium chromium-driver")
    webdriver = pytest.importorskip("selenium.webdriver", reason="pip install selenium (the test extra)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="vlforge-chromium-")
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
                "--window-size=1400,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def server(runs):
    """The viewer's app on a free loopback port, in a thread of this process."""
    import uvicorn

    from vlforge.view.app import build_app

    config = uvicorn.Config(build_app([runs]), host="127.0.0.1", port=0, log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.05)
    port = srv.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}/"
    srv.should_exit = True
    thread.join()


def wait_for(driver, script, timeout=30.0):
    """Poll a JS expression until it is truthy (the page loads its data asynchronously)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = driver.execute_script(f"return {script}")
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"never true in the page: {script}")


def check_page(driver, runs: Path) -> None:
    """What the page shows, against the run directories."""
    wait_for(driver, "document.querySelectorAll('#runs tbody tr').length == 2 && "
                     "document.querySelector('.chart[data-metric=\"reward_mean\"] .point')")
    states = driver.execute_script("return [...document.querySelectorAll('#runs tbody tr')].map("
                                   "r => [r.dataset.run, r.querySelector('.state').textContent])")
    assert states == [["grpo", "finished"], ["sft", "finished"]]
    # a curve: one marker per logged step, at the logged values (plotly's SVG and its data)
    grpo = [r for r in read_metrics(runs / "grpo" / "metrics.jsonl") if "reward_mean" in r]
    points = driver.execute_script("const d = document.querySelector('.chart[data-metric=\"reward_mean\"]');"
                                   "return [d.querySelectorAll('path.point').length, d.data[0].x, d.data[0].y]")
    assert points == [len(grpo), [r["step"] for r in grpo], [r["reward_mean"] for r in grpo]]
    losses = driver.execute_script("return document.querySelectorAll('.chart[data-metric=\"loss\"] path.point').length")
    sft = [r for r in read_metrics(runs / "sft" / "metrics.jsonl") if "loss" in r]
    assert losses == len(grpo) + len(sft)  # both runs overlaid
    # the rollout browser at the last logged step: its groups' images (decoded) and responses with rewards
    groups = [g for g in read_samples(runs / "grpo", "grpo") if g["step"] == 4]
    shown = driver.execute_script(
        "return [...document.querySelectorAll('#rollouts .group')].map(g => ["
        "[...g.querySelectorAll('.prompt img')].map(i => i.complete && i.naturalWidth > 0),"
        "[...g.querySelectorAll('tr.response')].map(r => [r.querySelector('.response-text').textContent,"
        "r.querySelector('.reward').textContent])])")
    assert len(shown) == len(groups) == 2
    for (loaded, responses), g in zip(shown, groups):
        assert loaded == [True] * len(g["images"]) and loaded
        assert [text for text, _ in responses] == [r["text"] for r in g["responses"]]
        assert [float(reward) for _, reward in responses] == pytest.approx([r["reward"] for r in g["responses"]],
                                                                           rel=1e-3)
    # the step slider moves to the first logged step's groups
    driver.execute_script("const s = document.getElementById('rollout-step'); s.value = 0;"
                          "s.dispatchEvent(new Event('input'))")
    first = [r["text"] for g in read_samples(runs / "grpo", "grpo") if g["step"] == 1 for r in g["responses"]]
    assert driver.execute_script("return [...document.querySelectorAll('#rollouts .response-text')]"
                                 ".map(e => e.textContent)") == first
    # the eval browser (the SFT run's): wrong answers marked wrong, at the checkpoint chosen
    driver.execute_script("const s = document.getElementById('eval-run');"
                          "s.value = [...s.options].find(o => o.text == 'sft').value; s.dispatchEvent(new Event('input'))")
    probes = [p for p in read_samples(runs / "sft", "eval") if p["step"] == 3]
    marks = driver.execute_script("return [...document.querySelectorAll('#evals .probe')].map(p => ["
                                  "p.querySelector('.side.b .answer').className, p.querySelector('.side.b .answer')"
                                  ".textContent])")
    assert len(marks) == len(probes) and any(not p["correct"] for p in probes)
    for (cls, text), p in zip(marks, probes):
        assert ("wrong" in cls.split()) == (not p["correct"]) and text == f"{'✓' if p['correct'] else '✗'} {p['answer']}"


def test_viewer_in_a_browser(runs, browser, server, tmp_path):
    browser.get(server)
    check_page(browser, runs)
    # the README's screenshot: the rollout browser at its last step, a few curves above it
    browser.get(server)
    wait_for(browser, "document.querySelector('#rollouts .group img')")
    browser.execute_script("const f = document.getElementById('metric-filter'); f.value = 'loss reward_mean';"
                           "f.dispatchEvent(new Event('input'))")
    browser.set_window_size(1400, 2200)
    time.sleep(0.5)  # plotly's resize
    target = SCREENSHOT if os.environ.get("VLFORGE_SCREENSHOT") else tmp_path / "view.png"
    target.parent.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(target))
    browser.set_window_size(1400, 1000)


def test_export_renders_the_same_offline(runs, browser, tmp_path):
    """--export: one file that renders the same with the browser's network off and no server."""
    from vlforge.cli import main

    report = tmp_path / "report.html"
    assert main(["view", str(runs), "--export", str(report)]) == 0
    browser.execute_cdp_cmd("Network.enable", {})
    browser.execute_cdp_cmd("Network.emulateNetworkConditions", {"offline": True, "latency": 0,
                                                                 "downloadThroughput": -1, "uploadThroughput": -1})
    try:
        browser.get(report.as_uri())
        check_page(browser, runs)
        requested = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
        assert [r for r in requested if not r.startswith("data:")] == []  # nothing fetched: all inline
    finally:
        browser.execute_cdp_cmd("Network.emulateNetworkConditions", {"offline": False, "latency": 0,
                                                                     "downloadThroughput": -1, "uploadThroughput": -1})


def test_run_states_from_the_lock_and_the_metrics(runs, tmp_path):
    """running while another process holds the run's lock (asked without taking it), crashed when it
    ended before its last step, stopped at a checkpoint of its last logged step."""
    from vlforge.view.runs import find_runs, run_summary

    run = tmp_path / "grpo"
    shutil.copytree(runs / "grpo", run)
    assert run_summary(run)["state"] == "finished"
    hold = (f"from vlforge.train.runtime import lock_output_dir as lock; lock({str(run)!r}); "
            "print('held', flush=True); import time; time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert run_summary(run)["state"] == "running"
    finally:
        holder.kill()
        holder.wait()
    # a run sized by train.epochs (no max_steps): its last checkpoint records the run's length
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["train"]["max_steps"] = None
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    assert run_summary(run)["state"] == "finished"
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(l for l in lines if json.loads(l)["step"] <= 3) + "\n")
    shutil.rmtree(run / "checkpoint-4")
    assert run_summary(run)["state"] == "crashed"  # step 3 logged, no checkpoint of it
    shutil.copytree(run / "checkpoint-2", run / "checkpoint-3")
    assert run_summary(run)["state"] == "stopped"
    assert find_runs([tmp_path]) == [run.resolve()]
    with pytest.raises(Exception, match="neither a run directory"):
        find_runs([tmp_path / "grpo" / "samples"])


def test_view_refuses_what_is_not_a_run_and_serves_only_thumbnails(runs, tmp_path, capsys):
    for extra in ("fastapi", "plotly"):
        pytest.importorskip(extra, reason="the view extra: pip install 'vlforge[view]'")
    from fastapi.testclient import TestClient

    from vlforge.cli import main
    from vlforge.view.app import build_app

    assert main(["view", str(tmp_path / "none"), "--export", str(tmp_path / "r.html")]) == 2
    assert "no such directory" in capsys.readouterr().err and not (tmp_path / "r.html").exists()
    client = TestClient(build_app([runs]))
    assert [r["name"] for r in client.get("/api/runs").json()] == ["grpo", "sft"]
    name = read_samples(runs / "grpo", "grpo")[0]["images"][0]
    assert client.get(f"/img/0/{name}").content == (runs / "grpo" / "samples" / name).read_bytes()
    for bad in ("/img/0/img/..%2F..%2Fconfig.yaml", "/img/0/img/" + "0" * 24 + ".png", f"/img/2/{name}",
                "/static/..%2Fapp.py", "/api/run/2"):
        assert client.get(bad).status_code == 404, bad


def test_the_page_follows_a_run_as_it_logs(runs, shapes_dir, browser, server):
    """The served page polls: the GRPO run resumed for two more steps while the page is open, its
    curve gains their points and the rollout browser moves to the newest step (last in this file:
    the run it grows is the module's)."""
    from vlforge.recipes.grpo import run_grpo

    browser.get(server)
    chart = "document.querySelector('.chart[data-metric=\"reward_mean\"]')"
    assert wait_for(browser, f"{chart} && {chart}.data && {chart}.data[0].x.length") == 4
    run_grpo(shapes_grpo(shapes_dir, runs / "grpo", runs, "log.samples_per_step=2", "train.max_steps=6",
                         "train.resume=auto"))
    wait_for(browser, f"{chart}.data[0].x.length == 6 && {chart}.querySelectorAll('path.point').length == 6")
    wait_for(browser, "document.getElementById('rollout-step-value').textContent == '6 (6 of 6 logged)'")
    texts = [r["text"] for g in read_samples(runs / "grpo", "grpo") if g["step"] == 6 for r in g["responses"]]
    assert browser.execute_script("return [...document.querySelectorAll('#rollouts .response-text')]"
                                  ".map(e => e.textContent)") == texts
