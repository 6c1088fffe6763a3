"""Kimi Delta Attention: per-channel gated delta rule (see naive.py for the rule).

CHUNK: the token chunk of the chunkwise kernels (FLA's and ours): a resumed prefill starts
on a multiple of it, so the cache's checkpoint grid is a multiple of it.

The CUDA path (kernels.kda.fla) is loaded by kernels.dispatch only on CUDA.
"""
from kernels.kda.chunk import chunk_kda
from kernels.kda.common import CHUNK
from kernels.kda.naive import naive_kda
from kernels.kda.recurrent import recurrent_kda

__all__ = ["CHUNK", "chunk_kda", "naive_kda", "recurrent_kda"]
