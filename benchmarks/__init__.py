"""Benchmarks: load generator, serving benchmark, baselines, KV calculator, per-stage measurement scripts."""
