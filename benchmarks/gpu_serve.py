"""The server on ONNX Runtime's CUDA EP, measured in one short run on a lent GPU machine.

Here, first: pack what the machine lacks into three parts (``--pack``), then the device calls, each
within 30 s of the last (the machine keeps ``.gpu/`` between calls only while it is held):

    .venv/bin/python -m benchmarks.gpu_serve --pack
    python3 -m benchmarks.gpu_serve --unpack .gpu/p1                  # carry [".gpu/p1"]
    python3 -m benchmarks.gpu_serve --unpack .gpu/p2                  # carry [".gpu/p2"]
    python3 -m benchmarks.gpu_serve --unpack .gpu/p3 --out "$OUT"     # carry [".gpu/p3"]: unpack, then run

The rehearsal of the same steps on the CPU EP (tests/test_gpu_serve.py runs it on the tiny model):

    .venv/bin/python -m benchmarks.gpu_serve --cpu --out /tmp/gpu_rehearsal

The run, written to ``--out``/gpu_serve.json (and each server's log beside it):
1. environment: onnxruntime's version and providers, the GPU (nvidia-smi);
2. build: the model (SmolLM2-135M-Instruct from its GGUF) -> the gqa graph -> the CUDA form (fp16 weights,
   activations and K/V: compress/quantize/cuda_fp16.py);
3. parity: one prompt batch through an ORT session on the CUDA EP and on the CPU EP, logits compared;
4. serve on the CUDA EP (``python -m serve``, K/V in GPU memory): the openai SDK streams greedy completions at each
   concurrency (tokens/s, TTFT, inter-token latency), GPU memory from /metrics, then a fixed greedy set;
5. serve the same artifact on the CPU EP: the same greedy set; token equality with the CUDA answers.
The rehearsal runs the server with ``serve.kv_store: torch``, the CUDA path's K/V code on the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import lzma
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

from benchmarks import run_modes
from loadtest import gpu_parts
from loadtest.gpu_parts import keep_one_arch

MODES_HELP = 'modes (each with its own --help): --pack: here, first: pack what the GPU machine lacks into parts (formerly benchmarks/gpu_pack.py)'
ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / ".gpu"
SITE = GPU / "site"
MODEL = GPU / "model" / "model.gguf"
CUDA_EP, CPU_EP = "CUDAExecutionProvider", "CPUExecutionProvider"
# The libraries onnxruntime-gpu's CUDA provider needs (readelf NEEDED, plus what it opens lazily): on the GPU
# machine they come with torch's nvidia-* packages, which are not on the loader's path.
CUDA_LIBS = ("libcublas", "libcudart", "libcurand", "libcufft", "libcudnn", "libnvrtc", "libnvJitLink")
DIRS_VAR = "GPU_SERVE_CUDA_DIRS"


# ---------------------------------------------------------------- unpacking the parts (on the GPU machine)

def unpack(part: Path) -> list[str]:
    """Unpack one part of ``--pack`` into .gpu/site and .gpu/model; returns what it wrote."""
    return gpu_parts.unpack(part, SITE, MODEL)


def cuda_library_dirs() -> list[str]:
    """Folders holding the CUDA libraries the provider loads: the nvidia-* packages and torch's lib beside this
    Python's site-packages, and the CUDA toolkit's (found once, then passed on in $GPU_SERVE_CUDA_DIRS)."""
    if DIRS_VAR in os.environ:
        return [d for d in os.environ[DIRS_VAR].split(os.pathsep) if d]
    sites = [Path(p) for p in sys.path if p.endswith("site-packages")]
    roots = [s / "nvidia" for s in sites] + [s / "torch" / "lib" for s in sites] + [Path("/usr/local/cuda/lib64")]
    dirs = set()
    for root in roots:
        for here, _, files in os.walk(root):
            if any(f.startswith(CUDA_LIBS) and ".so" in f for f in files):
                dirs.add(here)
    return sorted(dirs)


def _env(cpu: bool) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    paths = [str(ROOT)] + ([] if cpu else [str(SITE)])
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if not cpu and DIRS_VAR not in os.environ:
        dirs = cuda_library_dirs()
        env[DIRS_VAR] = os.pathsep.join(dirs)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(dirs + [env.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep)
    return env


# ---------------------------------------------------------------- the steps

def environment(cpu: bool) -> dict:
    import onnxruntime as ort

    info = {"onnxruntime": ort.__version__, "onnxruntime_file": ort.__file__,
            "providers": ort.get_available_providers(), "python": sys.version.split()[0]}
    if not cpu:
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                  "--format=csv,noheader"], capture_output=True, text=True)
            info["gpu"] = smi.stdout.strip() or smi.stderr.strip()
        except FileNotFoundError:
            info["gpu"] = "no nvidia-smi"
        info["cuda_library_dirs"] = cuda_library_dirs()
    return info


def build(source: str, work: Path) -> tuple[Path, dict]:
    """(the CUDA form's folder, timings) for the model ``source`` (as model.source reads it)."""
    from compress.export.gqa import build_gqa_artifact
    from compress.loading.models import load_teacher
    from compress.quantize.cuda_fp16 import write_fp16_artifact

    t0 = time.perf_counter()
    model, tok = load_teacher(source, cache_dir=work / "models")
    t1 = time.perf_counter()
    build_gqa_artifact(model, tok, work / "fp32")
    t2 = time.perf_counter()
    write_fp16_artifact(work / "fp32", work / "cuda")
    t3 = time.perf_counter()
    shutil.rmtree(work / "fp32")
    size = sum(f.stat().st_size for f in (work / "cuda").glob("model.onnx*"))
    return work / "cuda", {"load_s": round(t1 - t0, 1), "export_s": round(t2 - t1, 1),
                           "fp16_form_s": round(t3 - t2, 1), "graph_mib": round(size / 2**20, 1)}


def parity(artifact: Path, prompts: list[list[int]], cpu: bool) -> dict:
    """The first prompt batch through ORT sessions on each provider: last-position logits compared."""
    import numpy as np
    import onnxruntime as ort

    from serve.artifact import read_manifest

    m = read_manifest(artifact, verify=False)
    L, kv, d = int(m["num_layers"]), int(m["num_kv_heads"]), int(m["head_dim"])
    S, B = max(map(len, prompts)), len(prompts)
    ids = np.zeros((B, S), np.int64)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = p
    feed = {"input_ids": ids, "seqlens_k": np.array([len(p) - 1 for p in prompts], np.int32),
            "total_sequence_length": np.array(S, np.int32), "logits_to_keep": np.array([0], np.int64)}
    for i in range(L):
        for t in ("key", "value"):
            feed[f"past_key_values.{i}.{t}"] = np.zeros((B, kv, S, d), np.float16)
    out = {}
    for ep in ([CPU_EP] if cpu else [CUDA_EP, CPU_EP]):
        s = ort.InferenceSession(str(artifact / "model.onnx"), providers=[ep])
        t = time.perf_counter()
        logits = s.run(["logits"], feed)[0]
        out[ep] = (s.get_providers()[0], time.perf_counter() - t,
                   np.stack([logits[b, len(p) - 1] for b, p in enumerate(prompts)]))
    first, last = out[next(iter(out))], out[CPU_EP]
    return {"sessions": {ep: v[0] for ep, v in out.items()}, "seconds": {ep: round(v[1], 3) for ep, v in out.items()},
            "max_abs_logit_diff": float(np.abs(first[2] - last[2]).max()),
            "argmax_equal": float((first[2].argmax(-1) == last[2].argmax(-1)).mean())}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m serve`` on a free port, its log in ``log``."""

    def __init__(self, artifact: Path, log: Path, env: dict, settings: list[str]):
        self.port = _free_port()
        cmd = [sys.executable, "-m", "serve", "--model", str(artifact), "--port", str(self.port),
               "--served-model-name", "m"]
        for s in settings:
            cmd += ["--set", s]
        self.log = log
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait(self, timeout: float) -> float:
        import httpx

        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}): {self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not healthy after {timeout:.0f} s: {self.tail()}")

    def metrics(self) -> dict[str, float]:
        import httpx

        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(("compressor:gpu", "compressor:kv_bytes", "compressor:kv_budget", "vllm:kv_cache")):
                name, value = line.rsplit(" ", 1)
                out[name.split("{")[0]] = float(value)
        return out

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text()[-n:] if self.log.exists() else ""

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def corpus_prompts(n: int, seed: int = 0, words_max: int = 200) -> list[str]:
    """n prompts of 20-``words_max`` words from the embedded corpus (pydoc_data.topics)."""
    import random

    from pydoc_data.topics import topics

    words = " ".join(topics[k] for k in sorted(topics)).split()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k, start = rng.randint(min(20, words_max), words_max), rng.randrange(len(words) - words_max)
        out.append(" ".join(words[start:start + k]))
    return out


async def _stream(client, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    stamps, tokens = [], 0
    stream = await client.completions.create(model="m", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return {"ttft": stamps[0] - t0 if stamps else None, "itl": [b - a for a, b in zip(stamps, stamps[1:])],
            "tokens": tokens}


async def _level(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    import numpy as np
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    sem = asyncio.Semaphore(concurrency)
    errors: list[str] = []

    async def one(p):
        async with sem:
            try:
                return await _stream(client, p, max_tokens)
            except Exception as e:  # noqa: BLE001 - counted and reported
                errors.append(f"{type(e).__name__}: {e}"[:200])
                return None

    t0 = time.perf_counter()
    done = [r for r in await asyncio.gather(*(one(p) for p in prompts)) if r]
    wall = time.perf_counter() - t0
    await client.close()
    toks = sum(r["tokens"] for r in done)
    itl = [x for r in done for x in r["itl"]]
    ttft = [r["ttft"] for r in done if r["ttft"] is not None]
    pct = (lambda xs, q: round(1000 * float(np.percentile(xs, q)), 2) if xs else None)
    return {"concurrency": concurrency, "requests": len(prompts), "ok": len(done), "errors": errors[:3],
            "completion_tokens": toks, "wall_s": round(wall, 2), "tokens_per_s": round(toks / wall, 1),
            "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p95": pct(ttft, 95), "itl_ms_p50": pct(itl, 50),
            "itl_ms_p95": pct(itl, 95)}


def greedy_set(url: str, prompts: list[str], max_tokens: int) -> list[str]:
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    return [client.completions.create(model="m", prompt=p, max_tokens=max_tokens, temperature=0).choices[0].text
            for p in prompts]


def compare(tokenizer_dir: Path, a: list[str], b: list[str]) -> dict:
    """Token equality of two answer sets: exact answers, and the share of tokens before the first difference."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    same, prefix, total = 0, 0, 0
    for x, y in zip(a, b):
        tx, ty = tok.encode(x, add_special_tokens=False).ids, tok.encode(y, add_special_tokens=False).ids
        same += tx == ty
        k = next((i for i, (u, v) in enumerate(zip(tx, ty)) if u != v), min(len(tx), len(ty)))
        prefix += k
        total += max(len(tx), 1)
    return {"answers": len(a), "identical": same, "tokens_before_first_difference": round(prefix / max(total, 1), 3)}


def serve_and_measure(artifact: Path, out: Path, env: dict, cpu: bool, levels: list[int], max_tokens: int,
                      greedy: list[str], greedy_tokens: int, words_max: int, kv_store: str = "auto") -> dict:
    ep = CPU_EP if cpu else CUDA_EP
    settings = [f"serve.providers=[{ep},{CPU_EP}]", "serve.kv_memory_mb=" + ("256" if cpu else "8192"),
                f"serve.max_batch_size={max(levels)}", "serve.result_cache_size=0",
                f"serve.kv_store={'torch' if cpu else kv_store}"]
    srv = Server(artifact, out / f"server_{'cpu_rehearsal' if cpu else 'cuda'}_{kv_store}.log", env, settings)
    res: dict = {"settings": settings}
    try:
        res["startup_s"] = round(srv.wait(300), 1)
        res["metrics_idle"] = srv.metrics()
        t = time.perf_counter()
        greedy_set(srv.url, greedy[:2], 8)  # warm-up: the first calls load kernels and grow ORT's arena
        res["warmup_s"] = round(time.perf_counter() - t, 2)
        prompts = corpus_prompts(2 * max(levels), seed=1, words_max=words_max)
        res["levels"] = []
        for c in levels:
            r = asyncio.run(_level(srv.url, prompts[:2 * c], c, max_tokens))
            r["metrics_after"] = srv.metrics()
            res["levels"].append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "metrics_after"}), flush=True)
        t = time.perf_counter()
        res["greedy"] = greedy_set(srv.url, greedy, greedy_tokens)
        res["greedy_s"] = round(time.perf_counter() - t, 1)
    except Exception as e:  # noqa: BLE001 - the run goes on to the CPU EP part and reports this
        res["error"] = f"{type(e).__name__}: {e}"[:3000]
    finally:
        srv.stop()
    res["log_tail"] = srv.tail(1500)
    return res


def cpu_reference(artifact: Path, out: Path, env: dict, greedy: list[str], greedy_tokens: int) -> dict:
    srv = Server(artifact, out / "server_cpu.log", env, [f"serve.providers=[{CPU_EP}]", "serve.result_cache_size=0"])
    res: dict = {}
    try:
        res["startup_s"] = round(srv.wait(300), 1)
        t = time.perf_counter()
        res["greedy"] = greedy_set(srv.url, greedy, greedy_tokens)
        res["greedy_s"] = round(time.perf_counter() - t, 1)
    except Exception as e:  # noqa: BLE001 - reported
        res["error"] = f"{type(e).__name__}: {e}"[:3000]
    finally:
        srv.stop()
    return res


def run(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cpu = args.cpu
    env = _env(cpu)
    report: dict = {"mode": "cpu rehearsal" if cpu else "cuda", "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    t0 = time.perf_counter()

    def save():
        report["total_s"] = round(time.perf_counter() - t0, 1)
        (out / "gpu_serve.json").write_text(json.dumps(report, indent=1))

    report["environment"] = environment(cpu)
    print(json.dumps(report["environment"]), flush=True)
    work = Path(args.work)
    if args.artifact:
        artifact, report["build"] = Path(args.artifact), {"artifact": args.artifact}
    else:
        artifact, report["build"] = build(args.model, work)
    print(json.dumps(report["build"]), flush=True)
    save()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(artifact / "tokenizer.json"))
    greedy = corpus_prompts(args.greedy, seed=2, words_max=args.prompt_words)
    report["parity"] = parity(artifact, [tok.encode(p).ids[:64] for p in greedy[:4]], cpu)
    print(json.dumps(report["parity"]), flush=True)
    save()
    report["served"] = serve_and_measure(artifact, out, env, cpu, args.levels, args.max_tokens, greedy,
                                         args.greedy_tokens, args.prompt_words)
    save()
    if ("error" in report["served"] or args.host_kv) and not cpu:
        # the K/V in host memory, copied every call: the CUDA EP's figures even if the device rows failed, and
        # what keeping them on the device is worth
        report["served_host_kv"] = serve_and_measure(artifact, out, env, cpu, args.levels, args.max_tokens, greedy,
                                                     args.greedy_tokens, args.prompt_words, kv_store="host")
        save()
    report["cpu_ep"] = cpu_reference(artifact, out, env, greedy, args.greedy_tokens)
    served = next((report[k] for k in ("served", "served_host_kv") if report.get(k, {}).get("greedy")), None)
    if served and report["cpu_ep"].get("greedy"):
        report["equality"] = compare(artifact, served["greedy"], report["cpu_ep"]["greedy"])
        print(json.dumps(report["equality"]), flush=True)
    save()
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(epilog=MODES_HELP, prog="python -m benchmarks.gpu_serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--unpack", default=None, help="unpack this part (.gpu/pN) first")
    p.add_argument("--out", default=None, help="run, writing gpu_serve.json and the server logs here")
    p.add_argument("--cpu", action="store_true", help="the rehearsal: everything on the CPU EP")
    p.add_argument("--model", default=None,
                   help="model.source (default: the unpacked GGUF on the GPU, 'embedded' with --cpu)")
    p.add_argument("--work", default=str(GPU / "work"), help="where the artifacts are built")
    p.add_argument("--artifact", default=None, help="serve this CUDA-form artifact instead of building one")
    p.add_argument("--levels", type=int, nargs="+", default=None, help="concurrencies (default 1 8 32 64; --cpu 1 4)")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per request (default 128; --cpu 16)")
    p.add_argument("--greedy", type=int, default=16, help="prompts in the greedy equality set")
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=200, help="longest prompt, in corpus words")
    p.add_argument("--host-kv", action="store_true",
                   help="also serve with serve.kv_store host (K/V in host memory, copied every call) to compare")
    a = p.parse_args(argv)
    if a.unpack:
        print("unpacked:", unpack(Path(a.unpack)), flush=True)
    if not a.out:
        return 0
    if not a.cpu and str(SITE) not in sys.path:
        # onnxruntime-gpu from the unpacked parts, ahead of the machine's CPU build
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks.gpu_serve", "--out", a.out, *_rest(a)],
                  _env(False))
    a.model = a.model or ("embedded" if a.cpu else str(MODEL))
    a.levels = a.levels or ([1, 4] if a.cpu else [1, 8, 32, 64])
    a.max_tokens = a.max_tokens or (16 if a.cpu else 128)
    report = run(a)
    ok = "error" not in report.get("served", {})
    print(f"wrote {Path(a.out) / 'gpu_serve.json'} ({'ok' if ok else 'served part failed: ' + report['served']['error'][:300]})")
    return 0 if ok else 1


def _rest(a) -> list[str]:
    """The arguments to pass on when re-executing with the unpacked site on the path."""
    rest = ["--work", a.work, "--greedy", str(a.greedy), "--greedy-tokens", str(a.greedy_tokens),
            "--prompt-words", str(a.prompt_words)] + (["--host-kv"] if a.host_kv else [])
    rest += ["--model", a.model] if a.model else []
    rest += ["--artifact", a.artifact] if a.artifact else []
    rest += ["--levels", *map(str, a.levels)] if a.levels else []
    rest += ["--max-tokens", str(a.max_tokens)] if a.max_tokens else []
    return rest


# --- `--pack`: formerly benchmarks/gpu_pack.py --------------------------------------

PACK_DOC = """Pack what a lent GPU machine lacks for benchmarks/gpu_serve.py into parts that each fit one device call.

    .venv/bin/python -m benchmarks.gpu_serve --pack            # writes .gpu/p1, .gpu/p2, .gpu/p3 (git-ignored)

The GPU machine has CUDA 13, torch and the CPU onnxruntime, reaches no package registry, and takes at most 64 MiB
of working tree per call, the repository included. What it lacks:

- onnxruntime-gpu's CUDA provider (284 MB; 231 MB zipped). Its .nv_fatbin section holds the kernels for six GPU
  generations (sm_75 ... sm_120, 219 MB); every cubin not built for the target's arch (``--sm``, 90 for the
  H100/H200) is overwritten with zeros in place, so offsets and sizes stay as they were and the CUDA driver, which
  loads the cubin matching the device, never reads the zeros. xz then takes it to ~52 MB: part 1.
- the rest of the onnxruntime package (its Python binding, 31 MB), the wheels of the server's and the SDK's
  pure-Python needs for CPython 3.12, and the first half of SmolLM2-135M-Instruct's GGUF (98 MB): part 2.
- the GGUF's second half: part 3.

Each part is unpacked on the machine by ``python3 -m benchmarks.gpu_serve --unpack .gpu/pN`` into ``.gpu/site`` and
``.gpu/model`` (ignored, so they stay between calls while the machine is held); docs/serving.md#cuda has the
three calls.
"""

ORT_WHEEL = "onnxruntime-gpu==1.31.1"
PROVIDER = "onnxruntime/capi/libonnxruntime_providers_cuda.so"
# What the server, the builder and the openai SDK import that the GPU machine's image does not have (its package
# list: python3 there is CPython 3.12 with torch, transformers, numpy, httpx, anyio, jinja2, uvloop, ...).
WHEELS = ["pydantic==2.14.4", "pydantic_core==2.50.5", "annotated-types==0.8.0", "typing-inspection==0.4.5",
          "fastapi==0.150.0", "starlette==1.10.0", "uvicorn==0.55.0", "openai==3.60.0", "jiter==0.19.0",
          "distro==1.9.0", "sniffio==1.3.1", "gguf==0.19.0", "opentelemetry-api==1.45.2", "importlib_metadata==9.1.0",
          "annotated-doc==0.0.7", "httpx2==2.16.2", "httpcore2==2.16.2", "truststore==0.10.5", "idna==3.20",
          "anyio==4.16.0", "h11==0.16.0"]
PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:", "--no-deps",
            "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_27_x86_64",
            "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64"]
MIB = 2**20
CALL_LIMIT = 64 * MIB  # what one device call may carry, the repository included


def _section(path: Path, name: str) -> tuple[int, int]:
    """(file offset, size) of an ELF section, from readelf."""
    for line in subprocess.check_output(["readelf", "-S", "-W", str(path)], text=True).splitlines():
        if f" {name} " in line:
            fields = line.split("]", 1)[1].split()
            return int(fields[3], 16), int(fields[4], 16)
    raise SystemExit(f"{path}: no {name} section")


def _xz(data: bytes) -> bytes:
    return lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)


def pack(out: Path, sm: int, gguf: Path, cache: Path) -> dict[str, int]:
    cache.mkdir(parents=True, exist_ok=True)
    wheel = next(cache.glob("onnxruntime_gpu-*.whl"), None)
    if wheel is None:
        subprocess.check_call([sys.executable, "-m", "pip", "download", "-q", *PLATFORM, "-d", str(cache), ORT_WHEEL])
        wheel = next(cache.glob("onnxruntime_gpu-*.whl"))
    parts = {n: out / f"p{n}" for n in (1, 2, 3)}
    for p in parts.values():
        p.mkdir(parents=True, exist_ok=True)
        for f in p.iterdir():
            f.unlink() if f.is_file() else None
    with zipfile.ZipFile(wheel) as z:
        provider = cache / "provider.so"
        provider.write_bytes(z.read(PROVIDER))
        packed = cache / f"provider_sm{sm}.so.xz"  # minutes of xz: made once per wheel and arch
        if not packed.exists():
            off, size = _section(provider, ".nv_fatbin")
            data = bytearray(provider.read_bytes())
            zeroed, kept = keep_one_arch(data, off, size, sm)
            print(f"CUDA provider: cubins for sm_{sm} kept ({kept / 1e6:.1f} MB), others zeroed ({zeroed / 1e6:.1f} MB)")
            packed.write_bytes(_xz(bytes(data)))
        shutil.copy2(packed, parts[1] / "provider.so.xz")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for info in z.infolist():
                name = info.filename
                skip = name == PROVIDER or "providers_tensorrt" in name or "libonnxruntime.so" in name
                if skip or info.is_dir() or not name.startswith("onnxruntime/"):
                    continue  # libonnxruntime.so is the C API's library: the Python binding does not load it
                t = tarfile.TarInfo(name)
                t.size, t.mode = info.file_size, 0o755 if name.endswith(".so") else 0o644
                tar.addfile(t, io.BytesIO(z.read(info)))
        (parts[2] / "onnxruntime.tar.xz").write_bytes(_xz(buf.getvalue()))
    wheels = parts[2] / "wheels"
    wheels.mkdir(exist_ok=True)
    subprocess.check_call([sys.executable, "-m", "pip", "download", "-q", *PLATFORM, "-d", str(wheels), *WHEELS])
    blob = gguf.read_bytes()
    room = CALL_LIMIT - _repo_bytes() - _bytes(parts[2]) - 2 * MIB
    (parts[2] / "model.gguf.0").write_bytes(blob[:room])
    (parts[3] / "model.gguf.1").write_bytes(blob[room:])
    sizes = {f"p{n}": _bytes(p) for n, p in parts.items()}
    for name, b in sizes.items():
        total = b + _repo_bytes()
        print(f"{name}: {b / MIB:.1f} MiB (+ repository = {total / MIB:.1f} MiB of {CALL_LIMIT / MIB:.0f})")
        if total > CALL_LIMIT:
            raise SystemExit(f"{name} does not fit one device call")
    return sizes


def _bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _repo_bytes() -> int:
    """What travels with every call besides the carried part: tracked and untracked-not-ignored files."""
    names = subprocess.check_output(["git", "ls-files", "-co", "--exclude-standard", "-z"], text=True).split("\0")
    return sum(Path(n).stat().st_size for n in names if n and Path(n).is_file())


def pack_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_serve --pack", description=PACK_DOC,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=".gpu", help="where the parts go (default %(default)s, git-ignored)")
    p.add_argument("--sm", type=int, default=90, help="the GPU's SM arch whose kernels are kept (90: H100/H200)")
    p.add_argument("--gguf", default=None, help="the model's GGUF (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--cache", default=".cache/gpu_pack", help="where the downloaded wheel is kept")
    a = p.parse_args(argv)
    from compress.loading.models import embedded_gguf_path

    pack(Path(a.out), a.sm, Path(a.gguf) if a.gguf else embedded_gguf_path(), Path(a.cache))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_modes(main, {"--pack": pack_main}))
