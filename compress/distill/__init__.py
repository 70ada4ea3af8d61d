"""The distillation stage: the (pruned) student learns from the teacher, resumably, on one process or N DDP ranks.

Entry points (lazy: importing this package imports no torch):

* ``distill(student, teacher, splits, cfg, workdir, ...) -> DistillReport`` and ``resolve_device`` (train.py: the
  training loop);
* ``training_splits`` (data.py: ``distill.data``, the corpus's train blocks, the teacher's own samples, or both);
* ``launch_distill(job, nproc)`` / ``DistillJob`` (launch.py: torchrun over N ranks, ``python -m
  compress.distill.launch``);
* ``DistillReport`` / ``DistillError`` (report.py).

Beside them: optimizer_step.py (one step: the data order, each rank's share, the update), device_setup.py (device,
autocast, attention form, compile), loss.py (KD + hidden-state losses, the teacher top-k cache, eval), fused.py,
plan.py, checkpoint.py, schedules.py (temperature / alpha / learning rate per step), distributed.py (process-group
helpers) and settings.py (the ``distill:`` section). docs/distillation.md.
"""

from compress._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "train": ["distill", "resolve_device"],
    "data": ["training_splits"],
    "launch": ["DistillJob", "launch_distill"],
    "report": ["DistillError", "DistillReport"],
})
