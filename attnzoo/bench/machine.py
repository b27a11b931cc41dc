"""Which machine and software a benchmark ran on (the first five CSV columns)."""

from __future__ import annotations

import platform
import subprocess

import torch


def _triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except ImportError:  # triton is a dependency, but a CPU wheel of torch may come without it
        return ""


def _driver_version() -> str:
    """The NVIDIA driver version from nvidia-smi, or "" when there is none."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return ""


def machine_info(device: torch.device | None = None) -> dict[str, str]:
    """``gpu_name``, ``gpu_sm`` (e.g. "9.0"), ``driver``, ``torch_version``, ``triton_version``.

    Without CUDA (or for ``device`` cpu) the "GPU" is the CPU: its name is the processor description and
    sm/driver are empty.
    """
    on_gpu = torch.cuda.is_available() if device is None else device.type == "cuda"
    if on_gpu:
        major, minor = torch.cuda.get_device_capability()
        name, sm, driver = torch.cuda.get_device_name(), f"{major}.{minor}", _driver_version()
    else:
        name, sm, driver = f"CPU {platform.processor() or platform.machine()}", "", ""
    return {
        "gpu_name": name,
        "gpu_sm": sm,
        "driver": driver,
        "torch_version": torch.__version__,
        "triton_version": _triton_version(),
    }


def machine_tag(gpu_name: str) -> str:
    """A short file-name tag for a machine: "NVIDIA H100 80GB HBM3" -> "h100", CPUs -> "cpu"."""
    words = gpu_name.lower().replace("nvidia", "").split()
    if not words or gpu_name.startswith("CPU"):
        return "cpu"
    return "".join(ch for ch in words[0] if ch.isalnum()) or "gpu"
