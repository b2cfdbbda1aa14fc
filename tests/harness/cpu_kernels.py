"""Which CPU kernels torch runs here: the figure a recorded curve's bits depend on.

A CPU's model name does not settle its float bits: one "AMD EPYC" is AVX2 and has no bf16 dot
products, another AVX-512 with them, and torch's and oneDNN's kernels (their blocking, their
bf16 accumulation) follow those, not the name. So a curve recorded on one machine is reproduced
bit for bit where this fingerprint and torch's version are the recording's, and within float32's
rounding elsewhere."""

import torch

# the instruction-set extensions oneDNN picks its bf16 GEMMs by, beyond torch's capability level
_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_kernels() -> str:
    """torch's dispatch level and the bf16 extensions present: "AVX512+avx512_bf16", "AVX2"."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")))
    except (OSError, StopIteration):
        flags = []
    present = [name for name in _BF16_FLAGS if name in flags]
    return "+".join([torch.backends.cpu.get_cpu_capability(), *present])
