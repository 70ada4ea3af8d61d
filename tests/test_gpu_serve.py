"""The prepared GPU window (benchmarks/gpu_serve.py --pack, then the run) rehearsed on the CPU: the fatbin pruning
on a synthetic container, the unpacking of parts, and the whole run on the tiny model with the CUDA path's K/V code."""

from __future__ import annotations

import json
import lzma
import struct

from bench_cli import run_bench
from loadtest.gpu_parts import ELF_CUBIN, FATBIN_MAGIC, keep_one_arch, unpack


def _entry(kind: int, arch: int, payload: bytes) -> bytes:
    header = bytearray(64)
    struct.pack_into("<HHIQ", header, 0, kind, 0x0101, len(header), len(payload))
    struct.pack_into("<I", header, 28, arch)
    return bytes(header) + payload


def _container(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", FATBIN_MAGIC, 1, 16, len(body)) + body


def test_keep_one_arch_zeroes_other_cubins_in_place():
    sm80, sm90, ptx = b"\x80" * 40, b"\x90" * 24, b"ptx." * 4
    blob = b"\x11" * 8 + _container(_entry(ELF_CUBIN, 80, sm80), _entry(ELF_CUBIN, 90, sm90)) + \
        _container(_entry(1, 80, ptx))
    data = bytearray(blob)
    zeroed, kept = keep_one_arch(data, 8, len(blob) - 8, 90)
    assert (zeroed, kept) == (len(sm80), len(sm90) + len(ptx))
    assert len(data) == len(blob) and data[:8] == blob[:8]  # offsets and sizes as they were
    assert sm80 not in data and sm90 in data and ptx in data


def test_unpack_puts_each_part_in_place(tmp_path):
    site, model = tmp_path / "site", tmp_path / "model" / "model.gguf"
    p1, p2 = tmp_path / "p1", tmp_path / "p2"
    p1.mkdir()
    p2.mkdir()
    (p1 / "provider.so.xz").write_bytes(lzma.compress(b"ELF" * 1000))
    (p1 / "model.gguf.0").write_bytes(b"GGUF-first-")
    (p2 / "model.gguf.1").write_bytes(b"second")
    unpack(p1, site, model)
    assert not (tmp_path / "model" / "model.gguf").exists()  # half a model is never left as the model
    unpack(p2, site, model)
    assert (tmp_path / "site/onnxruntime/capi/libonnxruntime_providers_cuda.so").read_bytes() == b"ELF" * 1000
    assert (tmp_path / "model" / "model.gguf").read_bytes() == b"GGUF-first-second"


def test_cpu_rehearsal_of_the_whole_run(tmp_path):
    """The GPU run's steps on the CPU EP with the tiny model: build the CUDA form, serve it with its K/V in torch
    tensors (the device path's code), stream greedy completions through the openai SDK, compare with a plain
    CPU server token for token."""
    out = tmp_path / "out"
    r = run_bench("gpu_serve", "--cpu", "--model", "tiny", "--out", out, "--work", tmp_path / "work",
                  "--levels", "1", "4", "--max-tokens", "8", "--greedy", "4", "--greedy-tokens", "8",
                  "--prompt-words", "60")
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((out / "gpu_serve.json").read_text())
    served = report["served"]
    assert "serve.kv_store=torch" in served["settings"]
    assert [lv["ok"] for lv in served["levels"]] == [2, 8]
    assert all(lv["completion_tokens"] == 8 * lv["requests"] for lv in served["levels"])
    assert report["equality"] == {"answers": 4, "identical": 4, "tokens_before_first_difference": 1.0}
    assert report["parity"]["argmax_equal"] == 1.0
