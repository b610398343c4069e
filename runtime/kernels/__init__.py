"""Kernel modules and their launch wrappers; load_module picks the CUDA or CPU-harness path."""

from .loader import BACKENDS, load_module
from .sim_module import SimBuildError, SimKernelError, SimModule

__all__ = ["BACKENDS", "load_module", "SimBuildError", "SimKernelError", "SimModule"]
