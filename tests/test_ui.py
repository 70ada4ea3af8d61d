"""The MLflow UI as a user opens it, in headless Chromium: a real `mlflow server` on a port other than 5000 over the
store the tiny pipeline run wrote. The links in the champion's description and in the run's summary.md open the
pages they name (the runs view, not GenAI), and the compare page of the baseline and the champion starts with the
scorecard, with a value for both versions in every row.

Needs Playwright (the `ui` extra) and a Chromium binary ($CHROMIUM or /usr/bin/chromium); skipped without them,
with the reason. The links' targets are also checked without a browser in tests/test_flow.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

from compress.registry import store as registry
from compress.registry.scorecard import FIGURES, PREFIX

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
pytestmark = [
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"no Chromium at {CHROMIUM} (apt-get install chromium)"),
    pytest.mark.skipif(importlib.util.find_spec("playwright") is None,
                       reason="Playwright missing (pip install -e '.[ui]')"),
]
MODEL = "tiny-llama"
# A first visit, but with the assistant panel closed (it would cover a third of the page); the view (GenAI or Model
# training) is left at the UI's default, so a link must name the runs view (?workflowType=) to land there.
FRESH_BROWSER = "localStorage.setItem('mlflow.assistant.panelOpen_v1', 'false')"


@pytest.fixture(scope="module")
def ui(tiny_flow_run, mlflow_store):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert port != 5000
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", mlflow_store,
                             "--host", "127.0.0.1", "--port", str(port)],
                            env={**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "mlflow server did not start"
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def browser(ui):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


def _page(browser, url: str, text: str, state: str = "visible"):
    ctx = browser.new_context(viewport={"width": 1600, "height": 1000})
    ctx.add_init_script(FRESH_BROWSER)
    page = ctx.new_page()
    page.goto(url, wait_until="load")
    page.get_by_text(text, exact=False).first.wait_for(timeout=60_000, state=state)
    return page


def _links(page, needle: str) -> list[tuple[str, str]]:
    """(text, href) of the page's links whose href contains ``needle``."""
    found = page.eval_on_selector_all("a", "els => els.map(e => [e.textContent, e.getAttribute('href') || ''])")
    return [(t, h) for t, h in found if needle in h]


def _opens_run(browser, page, link_text: str, run_id: str) -> None:
    """Clicking the link opens the run's page, in the Model training view, on this UI's address (a new tab from a
    description, the same tab from a markdown artifact: whichever the UI chooses)."""
    run_name = registry._client().get_run(run_id).info.run_name
    before = list(page.context.pages)
    page.get_by_role("link", name=link_text).first.click()
    deadline = time.time() + 30
    while True:
        new = [p for p in page.context.pages if p not in before]
        tab = new[0] if new else page
        if f"/runs/{run_id}" in tab.url:
            break
        assert time.time() < deadline, f"{link_text!r} did not open run {run_id} (at {page.url})"
        page.wait_for_timeout(200)
    tab.get_by_text(run_name).first.wait_for(timeout=60_000)
    assert tab.url.startswith(page.url.split("#")[0]), tab.url
    nav = tab.inner_text("body")[:400]
    assert "Model registry" in nav and "Evaluation" not in nav, nav  # the runs view's sidebar, not GenAI's
    if tab is not page:
        tab.close()


def test_the_champion_description_links_open_the_runs_on_this_port(browser, ui):
    champ = registry.version_for_alias(MODEL, "champion")
    page = _page(browser, f"{ui}/#/models/{MODEL}/versions/{champ.version}", "Pipeline run")
    links = _links(page, "#/experiments/")
    targets = {t: h for t, h in links if t in ("Pipeline run", "verdict, checks and plots")}
    assert set(targets) == {"Pipeline run", "verdict, checks and plots"}, links
    for href in targets.values():
        assert href.startswith("#/experiments/") and href.endswith("?workflowType=machine_learning"), href
    _opens_run(browser, page, "verdict, checks and plots", champ.tags["accept_run_id"])
    pipeline_run = re.search(r"/runs/([0-9a-f]{32})", targets["Pipeline run"]).group(1)
    _opens_run(browser, page, "Pipeline run", pipeline_run)
    page.context.close()


def test_the_run_summary_link_opens_the_run(browser, ui, tiny_flow_run):
    run_id = tiny_flow_run["out"]["run_id"]
    exp = registry._client().get_run(run_id).info.experiment_id
    page = _page(browser, f"{ui}/#/experiments/{exp}/runs/{run_id}/artifacts/summary.md?workflowType="
                          "machine_learning", "Compression run")
    assert ("open the run", registry.run_route(exp, run_id)) in _links(page, f"/runs/{run_id}")
    _opens_run(browser, page, "open the run", run_id)
    page.context.close()


def test_the_compare_page_starts_with_the_scorecard_for_both_versions(browser, ui):
    base = registry.version_for_alias(MODEL, "baseline")
    champ = registry.version_for_alias(MODEL, "champion")
    runs = json.dumps({base.version: base.run_id, champ.version: champ.run_id}, separators=(",", ":"))
    url = f"{ui}/#/compare-model-versions?name={quote(json.dumps(MODEL), safe='')}&runs={quote(runs, safe='')}"
    page = _page(browser, url, f"{PREFIX}1_accepted", state="attached")
    rows = page.eval_on_selector_all("tr", "els => els.map(e => Array.from(e.cells).map(c => c.textContent.trim()))")
    metric_rows = [r for r in rows if len(r) == 3 and re.match(r"^[_a-z]", r[0]) and r[0] not in ("Run ID",)]
    first_metric = next(i for i, r in enumerate(metric_rows) if r[0] == FIGURES[0][0])
    card = metric_rows[first_metric:first_metric + len(FIGURES)]
    assert [r[0] for r in card] == [name for name, _, _ in FIGURES], card
    for name, b, c in card:
        assert b not in ("", "-") and c not in ("", "-"), (name, b, c)
    by_name = {r[0]: r for r in card}
    assert float(by_name[f"{PREFIX}2_size_ratio"][1]) == 1.0 and float(by_name[f"{PREFIX}2_size_ratio"][2]) < 1.0
    # nothing of the metrics table comes before the scorecard
    assert all(not r[0].startswith(("bench_", "chat_", "gate_")) for r in metric_rows[:first_metric])
    params = {r[0]: [x.strip('"') for x in r[1:]] for r in rows if len(r) == 3 and r[0].startswith(f"{PREFIX}0_")}
    assert params[f"{PREFIX}0_verdict"] == ["baseline", "accepted"], params
    assert params[f"{PREFIX}0_form"][0] == "fp32" and "int8" in params[f"{PREFIX}0_form"][1], params
    page.context.close()
