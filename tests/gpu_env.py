"""What the GPU tests need to know of this machine: whether freight's cuda transport
and PyTorch see a GPU, and the skip marker that says why not (the CPU-only CI has
neither). Imported by tests/test_gpu.py and tests/test_vllm_gpu.py."""

from __future__ import annotations

import pytest

import freight

CUDA_OK, CUDA_WHY = freight.cuda_status()

try:
    import torch

    TORCH_GPUS = torch.cuda.device_count() if CUDA_OK else 0
except ImportError:  # the CPU-only CI has no PyTorch
    torch = None
    TORCH_GPUS = 0

needs_gpu = pytest.mark.skipif(
    not CUDA_OK or TORCH_GPUS == 0,
    reason=f"no GPU here ({CUDA_WHY or 'PyTorch is not installed or sees no GPU'})",
)
