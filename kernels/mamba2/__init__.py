"""Mamba2 SSD kernels: `chunk_ssd` (prefill), `recurrent_ssd` (decode), `naive_ssd` (reference).

The CUDA wrappers live in kernels.mamba2.cuda and are loaded through kernels.dispatch only.
"""
from kernels.mamba2.chunk import chunk_ssd
from kernels.mamba2.naive import naive_ssd
from kernels.mamba2.recurrent import recurrent_ssd

__all__ = ["chunk_ssd", "naive_ssd", "recurrent_ssd"]
