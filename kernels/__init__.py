"""Pure tensor kernels for linear-attention hybrids: no engine types are imported here.

Use `kernels.dispatch.get(op, device)` to obtain the implementation for a device.
"""
from kernels.dispatch import get, ops

__all__ = ["get", "ops"]
