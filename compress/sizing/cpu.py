"""What this CPU can do, read from /proc/cpuinfo: detected, never assumed (flags differ between machines of a kind)."""

from __future__ import annotations

import re
from pathlib import Path


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags (x86 'flags', ARM 'Features'); empty where /proc/cpuinfo cannot be read."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    lines = (l for l in cpuinfo.splitlines() if l.lower().startswith(("flags", "features")))
    return set(re.findall(r"[a-z0-9_]+", " ".join(lines)))


def has_vnni(cpuinfo: str | None = None) -> bool:
    """True when the CPU has an 8-bit dot-product instruction (x86 VNNI, ARM dotprod).

    Without it ORT's u8 x s8 kernels add pairs of products in int16 and saturate
    (measured on such a CPU: perplexity 35k-2.1M instead of 17); 7-bit weights avoid that.
    """
    return bool(cpu_flags(cpuinfo) & {"avx512_vnni", "avx_vnni", "avxvnni", "amx_int8", "asimddp", "dotprod"})


def has_bf16(cpuinfo: str | None = None) -> bool:
    """True when the CPU multiplies bf16 natively (AVX-512 BF16, AMX-BF16, ARM bf16): torch's bf16 matmuls then run
    at about 4x its fp32 ones (AMX, measured on SmolLM2's shapes); elsewhere bf16 is emulated and slower."""
    return bool(cpu_flags(cpuinfo) & {"avx512_bf16", "amx_bf16", "bf16"})
