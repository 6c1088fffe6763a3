"""Kimi Delta Attention: per-channel gated delta rule (see naive.py for the rule).

The CUDA path (kernels.kda.fla) is loaded by kernels.dispatch only on CUDA.
"""
from kernels.kda.chunk import chunk_kda
from kernels.kda.naive import naive_kda
from kernels.kda.recurrent import recurrent_kda

__all__ = ["chunk_kda", "naive_kda", "recurrent_kda"]
