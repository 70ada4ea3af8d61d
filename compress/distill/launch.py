"""Distillation on several GPUs: start compress/distill/train.py on N processes through torchrun and collect the result.

The flow's distill task calls :func:`launch_distill` when ``distill.nproc_per_node > 1``. It writes
a :class:`DistillJob` (paths and the config, JSON) into the checkpoint folder and runs::

    python -m torch.distributed.run --standalone --nproc-per-node N -m compress.distill.launch <job.json>

Each rank loads the teacher and the student from their folders, joins the process group (NCCL on
GPUs, gloo on CPUs) and calls :func:`compress.distill.train.distill`; rank 0 prints each step's metrics as
a tagged JSON line, which the launcher hands to its ``on_log`` (the task logs them to MLflow, as in
the one-process case), writes the checkpoints and finally saves the best student to ``out_dir``.
The same job file runs on several nodes with torchrun's own rendezvous (docs/scaling.md). A killed
run resumes from its last checkpoint when launched again, on any number of ranks.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from compress.distill.train import per_rank_blocks, resolve_device
from compress.distill.checkpoint import REPORT
from compress.distill.report import DistillError, DistillReport

log = logging.getLogger(__name__)

JOB_FILE = "job.json"
# Set for the ranks: the process that launched them. If it dies (a killed flow run), they stop too
# instead of training on beside the re-run that resumes from the same checkpoint folder.
LAUNCHER_PID_ENV = "COMPRESSOR_DISTILL_LAUNCHER_PID"
METRICS_TAG = "@compressor-distill-metrics "
_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class DistillJob:
    teacher_dir: str  # Hugging Face folders (what the load and prune stages wrote)
    student_dir: str
    splits: str  # DataSplits .npz
    workdir: str  # checkpoints and report.json (shared by the ranks: one node, or a shared file system)
    out_dir: str  # the best student + tokenizer, save_pretrained by rank 0
    config: dict  # DistillConfig fields
    masks: str | None = None  # safetensors {param name: keep mask} of unstructured pruning
    teacher_layers: list[int] | None = None  # the teacher layer of each student layer (distill.hidden_weight)
    # How the teacher (a folder or a hub id) is loaded: as compress.loading.models.load_teacher takes it.
    cache_dir: str = ".cache/models"
    revision: str | None = None
    trust_remote_code: bool = False

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(asdict(self), indent=1))
        return path

    @classmethod
    def read(cls, path: str | Path) -> "DistillJob":
        return cls(**json.loads(Path(path).read_text()))


def check_processes(cfg, nproc: int) -> str:
    """Refuse a launch that cannot work, before any process starts; returns the device kind the ranks use."""
    per_rank_blocks(cfg, nproc)
    if resolve_device(cfg.device).type == "cuda":
        n_gpu = torch.cuda.device_count()
        if nproc > n_gpu:
            raise DistillError(f"distill.nproc_per_node is {nproc} but torch sees {n_gpu} CUDA device(s) on this "
                               f"node; lower distill.nproc_per_node to at most {n_gpu}")
        return "cuda"
    return "cpu"


def launch_distill(job: DistillJob, nproc: int, on_log: Callable[[int, dict], None] | None = None) -> DistillReport:
    """Run the job on ``nproc`` local processes through torchrun; return rank 0's report.

    ``on_log(step, metrics)`` gets what :func:`compress.distill.train.distill` would pass it, in this
    process, as rank 0 reports it. The ranks' other output is passed through to this process's
    stderr as it comes. A failing rank ends the whole run; the error then carries the last lines.
    """
    from compress.config import DistillConfig

    cfg = DistillConfig(**job.config)
    kind = check_processes(cfg, nproc)
    if kind == "cpu":
        log.warning("distill: %d CPU processes (gloo). This checks the multi-GPU path; on one CPU machine it is "
                    "not faster than one process", nproc)
    work = Path(job.workdir)
    work.mkdir(parents=True, exist_ok=True)
    job_path = job.write(work / JOB_FILE)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "compress.distill.launch", str(job_path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")])),
           LAUNCHER_PID_ENV: str(os.getpid())}
    log.info("distill: %s", " ".join(cmd))
    tail: collections.deque[str] = collections.deque(maxlen=40)
    with subprocess.Popen(cmd, cwd=_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          errors="replace") as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            text, metrics = _split_metrics(line)
            if metrics is not None and on_log is not None:
                on_log(metrics["step"], metrics["metrics"])
            if text.strip():
                sys.stderr.write(text)
                tail.append(text.rstrip())
        rc = proc.wait()
    if rc != 0:
        raise DistillError(f"torchrun distillation on {nproc} processes failed (exit code {rc}); last output:\n"
                           + "\n".join(tail))
    report_path = work / REPORT
    if not report_path.is_file():
        raise DistillError(f"torchrun distillation ended without {report_path}; last output:\n" + "\n".join(tail))
    return DistillReport.from_dict(json.loads(report_path.read_text()))


def _print_metrics(step: int, metrics: dict) -> None:
    """on_log of rank 0: one tagged line per call, written at once (the pipe is shared with the other ranks)."""
    sys.stdout.write(f"{METRICS_TAG}{json.dumps({'step': step, 'metrics': metrics})}\n")
    sys.stdout.flush()


def _split_metrics(line: str) -> tuple[str, dict | None]:
    """(the line's other text, the metrics record it carries or None); a progress bar may precede the tag."""
    at = line.find(METRICS_TAG)
    if at < 0:
        return line, None
    try:
        return line[:at], json.loads(line[at + len(METRICS_TAG):])
    except json.JSONDecodeError:
        return line, None


def _exit_with_launcher(interval_s: float = 2.0) -> None:
    """A daemon thread that ends this rank once the launching process is gone (torchrun then stops the others)."""
    pid = int(os.environ.get(LAUNCHER_PID_ENV, "0"))
    if pid <= 0:
        return  # started by hand with torchrun: nobody to follow

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                log.error("distill: the launching process %d is gone; stopping this rank", pid)
                os._exit(3)
            except PermissionError:
                pass  # alive, another user's

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def run_rank(job_path: str) -> None:
    """What one torchrun process does (``python -m compress.distill.launch job.json``)."""
    from safetensors.torch import load_file

    from compress.distill import distributed
    from compress.config import DistillConfig
    from compress.corpus.splits import DataSplits
    from compress.distill.train import distill
    from compress.loading.models import load_teacher

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # N ranks x 2 models of "Loading weights" bars
    job = DistillJob.read(job_path)
    cfg = DistillConfig(**job.config)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank%(rank)s %(name)s: %(message)s")
    rank = distributed.init_from_env(use_cuda=resolve_device(cfg.device).type == "cuda")
    old_factory = logging.getLogRecordFactory()

    def factory(*args, **kwargs):
        record = old_factory(*args, **kwargs)
        record.rank = rank.rank
        return record

    logging.setLogRecordFactory(factory)
    _exit_with_launcher()
    try:
        teacher, _ = load_teacher(job.teacher_dir, None, job.cache_dir, job.revision, job.trust_remote_code)
        student, tok = load_teacher(job.student_dir, None, job.cache_dir, job.revision, job.trust_remote_code)
        splits = DataSplits.load(job.splits)
        masks = {k: v.bool() for k, v in load_file(job.masks).items()} if job.masks else None
        distill(student, teacher, splits, cfg, job.workdir, masks=masks,
                on_log=_print_metrics if rank.main else None, progress=rank.main, teacher_layers=job.teacher_layers)
        if rank.main:
            student.save_pretrained(job.out_dir)
            tok.save_pretrained(job.out_dir)
        distributed.barrier(rank)
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: torchrun --nproc-per-node N -m compress.distill.launch <job.json>")
    run_rank(sys.argv[1])
