"""Gated DeltaNet: the KDA delta rule with one scalar gate per value head.

The CUDA path (kernels.gdn.fla) is loaded by kernels.dispatch only on CUDA.
"""
from kernels.gdn.chunk import chunk_gdn
from kernels.gdn.naive import naive_gdn
from kernels.gdn.recurrent import recurrent_gdn
from kernels.kda.common import CHUNK  # GDN runs the KDA algorithm

__all__ = ["CHUNK", "chunk_gdn", "naive_gdn", "recurrent_gdn"]
