"""Where the gqa runner's K/V lives: host numpy arrays for the CPU EP, device tensors for the CUDA EP.

serve/runners/gqa.py slices, gathers and copies its block pool and rows with numpy's indexing syntax, which torch
tensors share. The two stores here give it the few operations that differ: allocation, the pointer ORT binds,
a gather of blocks, and a sync before ONNX Runtime reads what a copy wrote. On the CUDA EP the pool and the rows
stay in GPU memory: GroupQueryAttention reads the past and appends the new K/V where they lie (IOBinding on device
pointers), prefix hits, refills and block write-backs are device-to-device copies, and only token ids go up and
last-position logits come down each step.

torch is imported here alone, and only when a runner keeps its K/V on a device (docs/architecture.md): the
server on the CPU EP still starts without it. ORT offers no slicing or copies of its own OrtValues, and torch is
already installed wherever the project is.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from serve.kv.memory import kv_zeros


class HostKv:
    """numpy arrays in host memory (kv_zeros: no transparent huge pages), bound as ``cpu``."""

    ort_device = "cpu"

    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)

    def zeros(self, shape: tuple[int, ...]):
        return kv_zeros(shape, self.dtype)

    @staticmethod
    def ptr(a) -> int:
        return a.ctypes.data

    @staticmethod
    def numel(a) -> int:
        return int(a.size)

    @staticmethod
    def contiguous(a) -> bool:
        return bool(a.flags.c_contiguous)

    def block_rows(self, pool, blocks: Sequence[int]):
        """The blocks ``blocks`` of ``pool`` [n_kv, num_blocks, H, bs, D] as positions: [n_kv, H, len * bs, D]."""
        g = pool[:, np.asarray(blocks, dtype=np.intp)]
        n_kv, nb, h, bs, d = g.shape
        return g.transpose(0, 2, 1, 3, 4).reshape(n_kv, h, nb * bs, d)

    def sync(self) -> None:
        """Host copies are done when they return."""

    def after_run(self, binding) -> None:
        """Outputs in host memory are written when the run returns."""

    def memory(self) -> dict[str, int]:
        return {}


class TorchKv(HostKv):
    """torch tensors on ``device`` ("cuda" for the CUDA EP; "cpu" rehearses the same code on the CPU EP)."""

    def __init__(self, dtype, device: str = "cuda"):
        import torch

        super().__init__(dtype)
        self._torch = torch
        self.device = torch.device(device)
        self.ort_device = "cuda" if self.device.type == "cuda" else "cpu"
        kinds = {np.float16: torch.float16, np.float32: torch.float32}
        if self.dtype.type not in kinds:
            raise ValueError(f"serve.kv_store torch holds float16 or float32 caches, not {self.dtype} (the int8 cache "
                             "is served from host memory: serve.kv_store auto or host)")
        self._tdtype = kinds[self.dtype.type]

    def zeros(self, shape: tuple[int, ...]):
        return self._torch.zeros(shape, dtype=self._tdtype, device=self.device)

    @staticmethod
    def ptr(a) -> int:
        return a.data_ptr()

    @staticmethod
    def numel(a) -> int:
        return a.numel()

    @staticmethod
    def contiguous(a) -> bool:
        return a.is_contiguous()

    def block_rows(self, pool, blocks: Sequence[int]):
        g = pool.index_select(1, self._torch.as_tensor(list(blocks), dtype=self._torch.long, device=self.device))
        n_kv, nb, h, bs, d = g.shape
        return g.permute(0, 2, 1, 3, 4).reshape(n_kv, h, nb * bs, d)

    def sync(self) -> None:
        # torch copies run on torch's stream, ORT on its own: wait for the copies before a run reads the rows
        if self.device.type == "cuda":
            self._torch.cuda.synchronize(self.device)

    def after_run(self, binding) -> None:
        if self.device.type == "cuda":
            binding.synchronize_outputs()  # the logits' copy to the host, before the engine samples them

    def memory(self) -> dict[str, int]:
        """GPU bytes: the device's total and free (every process: ORT's arena, torch's, the CUDA contexts) and
        what torch holds for the K/V."""
        if self.device.type != "cuda":
            return {}
        free, total = self._torch.cuda.mem_get_info(self.device)
        return {"gpu_total_bytes": int(total), "gpu_used_bytes": int(total - free),
                "gpu_kv_allocated_bytes": int(self._torch.cuda.memory_allocated(self.device))}


STORES = ("auto", "host", "torch")


def kv_store(setting: str, provider: str, dtype) -> HostKv:
    """The store for a runner on ``provider``: ``auto`` = device tensors on the CUDA EP for an fp16 cache (the
    CUDA form, compress/quantize/cuda_fp16.py), host arrays otherwise; ``torch`` = torch tensors on the CPU
    (rehearses the device path on the CPU EP); ``host`` = numpy."""
    if setting not in STORES:
        raise ValueError(f"kv store {setting!r}: one of {', '.join(STORES)}")
    on_cuda = provider == "CUDAExecutionProvider"
    if setting == "torch" or (setting == "auto" and on_cuda and np.dtype(dtype) == np.float16):
        return TorchKv(dtype, "cuda" if on_cuda else "cpu")
    return HostKv(dtype)
