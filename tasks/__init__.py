"""Prefect tasks, one per stage: each wraps a plain function of compress/ with its cache key, retries and MLflow
child run.

A task imports its stage's torch, onnx and onnxruntime code inside its body, not at module level: a flow run's
process imports every task module before it starts (docs/architecture.md), and a run that fails on its config or
is served from cache never needs those libraries.
"""
