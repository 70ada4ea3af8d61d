"""Screenshots of the MLflow UI over a pipeline store, for the docs.

Starts ``mlflow server`` on the store (or uses a running one), finds the experiment, the newest
pipeline (parent) run, the registered model with its versions and aliases, and writes four PNGs:

  1-runs-table.png         the experiment's runs table (the "Machine learning" view, not GenAI)
  2-pipeline-run.png       the newest parent run's page, with its stage (child) runs
  3-compare-versions.png   the model-version compare page: baseline, candidate, champion side by side
  3b-compare-key-figures.png  the same, folded to the scorecard (compress/registry/scorecard.py)
  4-registered-model.png   the registered model page: its versions and their aliases
  5-model-version.png      the champion's version page: its story (description, tags) and its MLflow Model schema

Not part of CI and not installed. It needs the ``ui`` extra (Playwright for Python) and a
Chromium binary (Debian: ``apt-get install -y chromium`` -> /usr/bin/chromium); Playwright's own
browser download (``playwright install``) is not used.

    .venv/bin/pip install -e '.[ui]'
    .venv/bin/python scripts/ui_screenshots.py --out docs/img/ui --port 5055
    .venv/bin/python -m scripts.ui_screenshots --config configs/tiny.yaml \
        --tracking-uri sqlite:////tmp/store/mlflow.db --out /tmp/png

The PNG paths go to stdout, one a line; progress goes to stderr. Exit status 1 with a message
when the store, the experiment, its runs or the registered model are missing.

One job, one script although over 400 lines: the docs' MLflow UI screenshots. Finding the
targets, the UI-state URLs and the page scripts (JS strings) exist only for the shots taken
in ``shoot``; it is a standalone, uninstalled tool, and splitting it would make it a package.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from urllib.parse import quote, urlsplit

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python scripts/ui_screenshots.py` puts scripts/ first, not the project
    sys.path.insert(0, str(ROOT))

PARENT_TAG = "mlflow.parentRunId"
# MLflow 3.x UI: the sidebar's GenAI / Machine learning switch, kept in localStorage (key `<key>_v<version>`,
# JSON value); the experiment page also takes it from `?workflowType=`. Without either the UI opens GenAI.
WORKFLOW_STORAGE_KEY = "mlflow.workflowType_v1"
WORKFLOW_ML = "machine_learning"
# On a server at localhost/127.0.0.1 the Assistant panel opens by itself on a browser's first visit and takes a
# third of the width; these keys say it has been opened before and is closed now.
UI_STORAGE = {WORKFLOW_STORAGE_KEY: WORKFLOW_ML,
              "mlflow.assistant.fab.autoOpenedOnFirstLoad_v1": True,
              "mlflow.assistant.panelOpen_v1": False}
COMPARE_ALIASES = ("baseline", "candidate", "champion")
# Runs-table columns shown by default, those of them the pipeline run has: the verdict and the figures the
# gate and the benchmark judge (the pipeline copies each stage's metrics onto its parent run).
DEFAULT_COLUMNS = ("tags.verdict", "gate_perplexity_ratio", "gate_top1_agreement", "quant_size_ratio",
                   "bench_output_tokens_per_s_ratio", "bench_e2e_p99_s_ratio")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


class ShotError(RuntimeError):
    """A problem the user can fix (missing store, run, model, browser): printed without a traceback."""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- arguments and the store

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="ui_screenshots", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/img/ui", help="folder for the PNGs (default: docs/img/ui)")
    ap.add_argument("--port", type=int, default=5055, help="port of the mlflow server started here (default: 5055)")
    ap.add_argument("--host", default="127.0.0.1", help="interface it binds (default: 127.0.0.1)")
    ap.add_argument("--config", default="configs/default.yaml",
                    help="pipeline config giving the model name, experiment and store (default: configs/default.yaml)")
    ap.add_argument("--tracking-uri",
                    help="sqlite:////abs/path/mlflow.db (a server is started on it), or http(s)://... of a running "
                         "server (used as is). Default: the config's mlflow.tracking_uri, else $MLFLOW_TRACKING_URI, "
                         "else sqlite:///<project>/mlruns/mlflow.db")
    ap.add_argument("--experiment", help="experiment name (default: the config's mlflow.experiment)")
    ap.add_argument("--model", help="registered model name (default: the config's registry.model_name)")
    ap.add_argument("--run", help="parent run id to show (default: the newest run that has child runs)")
    ap.add_argument("--versions", help="versions to compare, e.g. 1,3,4 (default: the baseline, candidate and "
                                       "champion aliases)")
    ap.add_argument("--chromium", default=os.environ.get("CHROMIUM", "/usr/bin/chromium"),
                    help="Chromium binary (default: $CHROMIUM or /usr/bin/chromium)")
    ap.add_argument("--width", type=int, default=1600)
    ap.add_argument("--height", type=int, default=1000)
    ap.add_argument("--columns",
                    help="runs-table columns, comma-separated metric names or metrics.X / params.X / tags.X "
                         f"(default: those of {', '.join(DEFAULT_COLUMNS)} the pipeline run has)")
    ap.add_argument("--max-height", type=int, default=8000,
                    help="the compare and registered-model shots grow to their content, up to this many pixels "
                         "(default: 8000)")
    ap.add_argument("--timeout", type=float, default=90.0,
                    help="seconds to wait for the server and for each page (default: 90)")
    return ap.parse_args(argv)


def resolve(args: argparse.Namespace) -> tuple[str, str, str]:
    """(tracking uri, experiment, model name) from the arguments and the config file."""
    from compress.config import ConfigError, load_config

    cfg_path = Path(args.config)
    if not cfg_path.is_absolute() and not cfg_path.exists():
        cfg_path = ROOT / cfg_path
    try:
        cfg = load_config(cfg_path)
    except ConfigError as e:
        raise ShotError(str(e)) from None
    uri = (args.tracking_uri or cfg.mlflow.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
           or f"sqlite:///{ROOT / 'mlruns' / 'mlflow.db'}")
    return uri, args.experiment or cfg.mlflow.experiment, args.model or cfg.registry.model_name


def sqlite_path(uri: str) -> Path:
    if not uri.startswith("sqlite:///"):
        raise ShotError(f"tracking URI {uri!r}: expected sqlite:////absolute/path/mlflow.db or http(s)://host:port")
    db = Path(uri[len("sqlite:///"):])
    if not db.is_absolute():
        db = (Path.cwd() / db).resolve()
    if not db.is_file():
        # `mlflow server` would create an empty store there; say what is missing instead.
        raise ShotError(f"no MLflow store at {db}; run the pipeline first (make demo, or "
                        f"compressor run --config ...) or pass --tracking-uri sqlite:////path/to/mlflow.db")
    return db


# ---------------------------------------------------------------- the mlflow server

class Server:
    """`mlflow server` on a sqlite store, in its own process group, stopped on exit."""

    def __init__(self, db: Path, host: str, port: int):
        self.db, self.host, self.port = db, host, port
        self.url = f"http://{host}:{port}"
        self.proc: subprocess.Popen | None = None
        self.log_file = tempfile.NamedTemporaryFile(prefix="ui-screenshots-mlflow-", suffix=".log", delete=False)

    def start(self, timeout: float) -> None:
        with socket.socket() as s:
            s.settimeout(1)
            if s.connect_ex((self.host, self.port)) == 0:
                raise ShotError(f"port {self.port} on {self.host} is already in use; pass another --port "
                                f"(or --tracking-uri http://{self.host}:{self.port} to use that server)")
        exe = Path(sys.executable).with_name("mlflow")
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "mlflow"]
        cmd += ["server", "--backend-store-uri", f"sqlite:///{self.db}",
                "--default-artifact-root", str(self.db.parent),
                "--host", self.host, "--port", str(self.port), "--workers", "1"]
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
        log(f"starting {' '.join(cmd)}  (log: {self.log_file.name})")
        self.proc = subprocess.Popen(cmd, stdout=self.log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ShotError(f"mlflow server exited with status {self.proc.returncode}:\n{self.tail()}")
            if health(self.url):
                log(f"mlflow server up at {self.url}")
                return
            time.sleep(0.5)
        raise ShotError(f"mlflow server not healthy at {self.url}/health after {timeout:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(Path(self.log_file.name).read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            # The server's own process group (start_new_session): uvicorn and its worker.
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=15)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.log_file.close()
        try:
            os.unlink(self.log_file.name)
        except OSError:
            pass


def health(url: str) -> bool:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=2) as r:
            return r.status == 200
    except Exception:
        return False


# ---------------------------------------------------------------- what to show

def find_targets(url: str, experiment: str, model: str, run_id: str | None, versions: str | None,
                 columns: str | None = None) -> dict:
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient(tracking_uri=url, registry_uri=url)

    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        names = [e.name for e in client.search_experiments()]
        raise ShotError(f"no experiment {experiment!r} in the store (it has: {', '.join(names) or 'none'}); "
                        f"pass --experiment or --config")
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"], max_results=1000)
    if not runs:
        raise ShotError(f"experiment {experiment!r} has no runs; run the pipeline first")
    children: dict[str, list] = {}
    for r in runs:
        if PARENT_TAG in r.data.tags:
            children.setdefault(r.data.tags[PARENT_TAG], []).append(r)
    if run_id:
        parent = next((r for r in runs if r.info.run_id == run_id), None)
        if parent is None:
            raise ShotError(f"run {run_id} is not in experiment {experiment!r}")
    else:
        parents = [r for r in runs if PARENT_TAG not in r.data.tags and r.info.run_id in children]
        if not parents:
            raise ShotError(f"experiment {experiment!r} has no pipeline run (a run with child runs); "
                            f"run the pipeline first")
        parent = parents[0]

    try:
        rm = client.get_registered_model(model)
    except MlflowException:
        names = [m.name for m in client.search_registered_models()]
        raise ShotError(f"no registered model {model!r} (the store has: {', '.join(names) or 'none'}); "
                        f"pass --model or --config") from None
    all_versions = sorted(client.search_model_versions(f"name='{model}'"), key=lambda v: int(v.version))
    if not all_versions:
        raise ShotError(f"registered model {model!r} has no versions")
    by_number = {str(v.version): v for v in all_versions}
    aliases = {a: str(v) for a, v in (rm.aliases or {}).items()}

    if versions:
        picked = [v.strip() for v in versions.split(",") if v.strip()]
        missing = [v for v in picked if v not in by_number]
        if missing:
            raise ShotError(f"{model} has no version {', '.join(missing)} (it has {', '.join(by_number)})")
    else:
        picked = []
        for alias in COMPARE_ALIASES:
            if alias in aliases and aliases[alias] in by_number and aliases[alias] not in picked:
                picked.append(aliases[alias])
        # Fewer than two aliased versions: the newest others, so the page compares something.
        for v in reversed(all_versions):
            if len(picked) >= 2:
                break
            if str(v.version) not in picked:
                picked.append(str(v.version))
    picked.sort(key=int)

    if columns:
        wanted = [c.strip() for c in columns.split(",") if c.strip()]
    else:
        have = {f"metrics.{k}" for k in parent.data.metrics} | {f"tags.{k}" for k in parent.data.tags}
        wanted = [c for c in DEFAULT_COLUMNS if (c if "." in c else f"metrics.{c}") in have]

    return {
        "experiment_id": exp.experiment_id, "experiment": exp.name, "columns": [column_key(c) for c in wanted],
        "parent": parent, "children": sorted(children.get(parent.info.run_id, []), key=lambda r: r.info.start_time),
        "model": model, "aliases": aliases, "versions": all_versions,
        "compare": {v: by_number[v].run_id for v in picked},
    }


# The scorecard (compress/registry/scorecard.py): the params and metrics that decide between versions, which sort first.
SCORECARD_JS = """(prefix) => {
  for (const body of document.querySelectorAll('tbody.scrollable-table')) {
    const rows = [...body.querySelectorAll('tr')];
    const name = r => (r.querySelector('th') || {}).textContent?.trim() || '';
    if (!rows.some(r => name(r).startsWith(prefix))) continue;
    for (const r of rows) r.style.display = name(r).startsWith(prefix) ? '' : 'none';
    body.style.maxHeight = 'none';
  }
}"""


def column_key(name: str) -> str:
    """`gate_top1_agreement` or `metrics.gate_top1_agreement` -> the runs table's key metrics.`gate_top1_agreement`."""
    kind, _, key = name.partition(".")
    if kind not in ("metrics", "params", "tags", "attributes") or not key:
        kind, key = "metrics", name
    return f"{kind}.`{key.strip('`')}`"


def runs_table_state(experiment_id: str, columns: list[str], expanded_run: str) -> dict:
    """localStorage entry the runs table starts from: which columns it shows and which parent rows are open.

    MLflow 3.x persists the experiment page's state under this key (`getStoreForComponent("ExperimentPage",
    [ids])`); the fields not given keep their defaults.
    """
    key = f"MLflowLocalStorage-1.1-ExperimentPage-{json.dumps([str(experiment_id)])}-ReactComponentState"
    return {key: {"selectedColumns": list(columns), "runsExpanded": {expanded_run: True}}}


# ---------------------------------------------------------------- UI routes (MLflow 3.x, hash router)

def runs_table_url(base: str, experiment_id: str) -> str:
    return f"{base}/#/experiments/{experiment_id}/runs?workflowType={WORKFLOW_ML}"


def run_page_url(base: str, experiment_id: str, run_id: str) -> str:
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}"


def model_page_url(base: str, model: str) -> str:
    return f"{base}/#/models/{quote(model, safe='')}"


def compare_versions_url(base: str, model: str, version_runs: dict[str, str | None]) -> str:
    """`?name=` must come first: the page reads the query unstripped, as key "?name"; both values are JSON.

    The UI builds it as name=JSON.stringify(encodeURIComponent(name)) and runs=JSON.stringify({version: run_id}).
    """
    name = json.dumps(quote(model, safe="-_.!~*'()"))
    runs = json.dumps(version_runs, separators=(",", ":"))
    return f"{base}/#/compare-model-versions?name={quote(name, safe='')}&runs={quote(runs, safe='')}"


# ---------------------------------------------------------------- the browser

# The runs table's column order (ag-grid col ids, the chosen ones in the order asked within their group) and
# widths that fit the chosen columns' header names.
FIT_COLUMNS_JS = """(cols) => {
  const cells = [...document.querySelectorAll('.ag-header-row-column .ag-header-cell[col-id]')]
    .sort((a, b) => (+a.getAttribute('aria-colindex')) - (+b.getAttribute('aria-colindex')));
  const ids = cells.map(c => c.getAttribute('col-id'));
  if (!cols.every(c => ids.includes(c))) return null;
  const order = ids.slice();
  for (const kind of ['metrics.', 'params.', 'tags.']) {
    const slots = ids.map((id, i) => cols.includes(id) && id.startsWith(kind) ? i : -1).filter(i => i >= 0);
    const want = cols.filter(c => c.startsWith(kind));
    slots.forEach((slot, j) => { order[slot] = want[j]; });
  }
  const widths = {}, extra = {};
  let used = 0;
  for (const cell of cells) {
    // MLflow's own header cell: the name in a span whose box clips it with an ellipsis.
    const id = cell.getAttribute('col-id');
    const name = cell.querySelector('[data-testid^="sort-header-"]') || cell.querySelector('.ag-header-cell-text');
    const box = name && (name.classList.contains('ag-header-cell-text') ? name : name.parentElement);
    const width = cell.getBoundingClientRect().width;
    used += width;
    if (cols.includes(id) && box && box.scrollWidth > box.clientWidth) {
      widths[id] = width;
      extra[id] = box.scrollWidth - box.clientWidth + 16;
    }
  }
  // No wider than the table: columns past its right edge are not rendered at all.
  const grid = document.querySelector('.ag-root');
  const room = (grid ? grid.clientWidth : window.innerWidth) - used - 24;
  const want = Object.values(extra).reduce((a, b) => a + b, 0);
  const scale = want > 0 ? Math.max(0, Math.min(1, room / want)) : 0;
  for (const id in widths) widths[id] = Math.floor(widths[id] + extra[id] * scale);
  return {order, widths};
}"""

# How many pixels the tallest scrolled pane hides (0 when everything fits).
GROW_JS = """() => {
  let extra = Math.max(0, document.documentElement.scrollHeight - window.innerHeight);
  for (const el of document.querySelectorAll('body *')) {
    const oy = getComputedStyle(el).overflowY;
    if ((oy === 'auto' || oy === 'scroll') && el.clientHeight > 0 && el.scrollHeight > el.clientHeight + 1)
      extra = Math.max(extra, el.scrollHeight - el.clientHeight);
  }
  return extra;
}"""


def shoot(base: str, t: dict, out: Path, args: argparse.Namespace) -> list[Path]:
    try:
        from playwright.sync_api import Error as PlaywrightError
        from playwright.sync_api import TimeoutError as PlaywrightTimeout
        from playwright.sync_api import sync_playwright
    except ImportError:
        raise ShotError("Playwright for Python is missing: .venv/bin/pip install -e '.[ui]' "
                        "(no `playwright install` needed: it drives the system Chromium)") from None
    if not Path(args.chromium).exists():
        raise ShotError(f"no Chromium at {args.chromium}: apt-get install -y chromium, or pass --chromium PATH")

    timeout_ms = args.timeout * 1000
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    parent = t["parent"]
    parent_name = parent.info.run_name or parent.info.run_id

    def columns_rendered(page, cols: list[str]) -> bool:
        """The chosen columns are in the table (they come from MLflow's own stored state: version-specific)."""
        try:
            for col in cols:
                page.locator(f".ag-header-cell[col-id={json.dumps(col)}]").first.wait_for(state="attached",
                                                                                      timeout=10000)
        except PlaywrightTimeout:
            return False
        return True

    def settle(page) -> None:
        """Network quiet, then the frame after it painted (the UI polls, so networkidle may never come)."""
        try:
            page.wait_for_load_state("networkidle", timeout=5000)
        except PlaywrightTimeout:
            pass
        # No focus ring on an autofocused search box; then the frame after the last paint.
        page.evaluate("() => { document.activeElement && document.activeElement.blur && document.activeElement.blur();"
                      " return new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r))); }")

    def save(page, name: str, grow: bool = False) -> None:
        """Screenshot; `grow`: first make the window as tall as the content (up to --max-height).

        The UI scrolls inside its own panes (the page itself is one screen high), so full_page shows no
        more than the viewport; a taller viewport does.
        """
        settle(page)
        if grow:
            for _ in range(3):  # tables render more rows once they have room
                extra = page.evaluate(GROW_JS)
                height = min(page.viewport_size["height"] + extra, args.max_height)
                if extra <= 0 or height == page.viewport_size["height"]:
                    break
                page.set_viewport_size({"width": args.width, "height": height})
                settle(page)
        path = out / name
        page.screenshot(path=str(path))
        written.append(path)
        print(path, flush=True)
        page.set_viewport_size({"width": args.width, "height": args.height})

    with sync_playwright() as pw:
        try:
            # Chromium refuses some ports outright (net::ERR_UNSAFE_PORT: 5060, 5061, 6000, 6665-6669, ...).
            port = urlsplit(base).port or (443 if base.startswith("https") else 80)
            browser = pw.chromium.launch(executable_path=args.chromium, headless=True,
                                         args=[*CHROMIUM_ARGS, f"--explicitly-allowed-ports={port}"])
        except PlaywrightError as e:
            raise ShotError(f"could not start Chromium {args.chromium}: {e}") from None
        page = None
        try:
            ctx = browser.new_context(viewport={"width": args.width, "height": args.height},
                                      locale="en-US", timezone_id="UTC", color_scheme="light")

            def set_storage(entries: dict) -> None:  # written before the UI's own scripts, on every page load
                ctx.add_init_script("try {" + "".join(
                    f"localStorage.setItem({json.dumps(k)}, {json.dumps(json.dumps(v))});" for k, v in entries.items())
                    + "} catch (e) {}")

            # The "Machine learning" workflow everywhere (runs table; model registry in the sidebar), the
            # Assistant panel closed, and the runs table with the chosen columns and the pipeline run open.
            table_state = runs_table_state(t["experiment_id"], t["columns"], parent.info.run_id)
            set_storage({**UI_STORAGE, **table_state})
            # Nothing but the server: no fonts, telemetry or docs from the internet to wait for.
            ctx.route("**/*", lambda route: route.continue_() if route.request.url.startswith(base)
                      else route.abort())
            ctx.set_default_timeout(timeout_ms)
            page = ctx.new_page()

            # 1. the runs table of the experiment
            url = runs_table_url(base, t["experiment_id"])
            log(f"runs table: {url}")
            page.goto(url)
            page.get_by_text(parent_name, exact=True).first.wait_for(state="visible")
            columns_shown = columns_rendered(page, t["columns"])
            fit = page.evaluate(FIT_COLUMNS_JS, t["columns"]) if t["columns"] and columns_shown else None
            if fit and fit["widths"]:  # wide enough for the header names: reload with the widths stored
                for state in table_state.values():
                    state.update(columnOrder=fit["order"], columnWidths=fit["widths"])
                set_storage(table_state)
                page.reload()
                page.get_by_text(parent_name, exact=True).first.wait_for(state="visible")
            if t["children"]:  # stage runs open under the pipeline run; if the stored state did not take, click
                first_stage = page.locator(".ag-row", has_text=t["children"][0].info.run_name).first
                try:
                    first_stage.wait_for(state="visible", timeout=5000)
                except PlaywrightTimeout:
                    page.locator(".ag-row", has_text=parent_name).first.locator(
                        "button[data-component-id*='runnamecellrenderer']").first.click()
                    first_stage.wait_for(state="visible")
            if not columns_rendered(page, t["columns"]):
                log(f"warning: the runs table does not show all of {', '.join(t['columns'])}: no such metric/param/tag "
                    f"on these runs, or an MLflow UI that ignores the stored column choice")
            save(page, "1-runs-table.png")

            # 2. the pipeline (parent) run and its stage runs
            url = run_page_url(base, t["experiment_id"], parent.info.run_id)
            log(f"pipeline run: {url}")
            page.goto(url)
            page.get_by_text("Child runs", exact=True).first.wait_for(state="visible")
            if t["children"]:
                page.get_by_role("link", name=t["children"][-1].info.run_name, exact=True).first.wait_for(
                    state="visible")
            more = page.get_by_role("button", name="Load more")
            for _ in range(20):  # the overview lists 10 child runs a page
                if not more.count() or not more.first.is_visible():
                    break
                n = page.locator("a[href*='/runs/']").count()
                more.first.click()
                page.wait_for_function(f"() => document.querySelectorAll(\"a[href*='/runs/']\").length > {n}")
            save(page, "2-pipeline-run.png")

            # 3. model versions side by side
            compare = t["compare"]
            url = compare_versions_url(base, t["model"], compare)
            log(f"compare versions {', '.join(compare)}: {url}")
            page.goto(url)
            page.get_by_text(f"Comparing {len(compare)} Versions").first.wait_for(state="visible")
            page.get_by_text("Run ID:").first.wait_for(state="visible")
            save(page, "3-compare-versions.png", grow=True)
            # The same page folded to the scorecard (what an operator decides on), params and metrics.
            from compress.registry.scorecard import PREFIX

            page.evaluate(SCORECARD_JS, PREFIX)
            page.set_viewport_size({"width": args.width, "height": max(args.height, 1450)})
            save(page, "3b-compare-key-figures.png")

            # 4. the registered model: versions and aliases
            url = model_page_url(base, t["model"])
            log(f"registered model: {url}")
            page.goto(url)
            newest = str(t["versions"][-1].version)
            page.get_by_role("link", name=f"Version {newest}", exact=True).first.wait_for(state="visible")
            for alias in t["aliases"]:
                page.get_by_text(alias, exact=False).first.wait_for(state="visible")
            save(page, "4-registered-model.png", grow=True)

            # 5. the champion's (else the newest) version page: its description (verdict, links), tags and the
            # MLflow Model's schema (serve/api/mlflow_model.py)
            shown = t["aliases"].get("champion", newest)
            url = f"{base}/#/models/{quote(t['model'], safe='')}/versions/{shown}"
            log(f"model version: {url}")
            page.goto(url)
            page.get_by_text("Inputs (", exact=False).first.wait_for(state="visible")
            save(page, "5-model-version.png", grow=True)
        except PlaywrightTimeout as e:
            raise ShotError(f"page did not render in {args.timeout:.0f} s ({page.url if page else base}): "
                            f"{e.message.splitlines()[0]}") from None
        except PlaywrightError as e:
            raise ShotError(f"browser error at {page.url if page else base}: {e.message.splitlines()[0]}") from None
        finally:
            browser.close()
    return written


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server: Server | None = None
    try:
        uri, experiment, model = resolve(args)
        if uri.startswith(("http://", "https://")):
            base = uri.rstrip("/")
            if not health(base):
                raise ShotError(f"no MLflow server answers at {base}/health")
        else:
            server = Server(sqlite_path(uri), args.host, args.port)
            server.start(args.timeout)
            base = server.url
        targets = find_targets(base, experiment, model, args.run, args.versions, args.columns)
        p = targets["parent"]
        log(f"experiment {targets['experiment']!r} ({targets['experiment_id']}); pipeline run {p.info.run_name} "
            f"({p.info.run_id}, {len(targets['children'])} stage runs); model {model!r}: "
            f"{len(targets['versions'])} versions, aliases {targets['aliases'] or 'none'}")
        shoot(base, targets, Path(args.out), args)
        return 0
    except ShotError as e:
        log(f"ui_screenshots: error: {e}")
        return 1
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
