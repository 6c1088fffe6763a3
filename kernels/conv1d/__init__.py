"""Causal depthwise conv1d with a conv state: `causal_conv1d` (prefill), `causal_conv1d_update`
(decode), `naive_causal_conv1d` (reference).

The CUDA wrappers live in kernels.conv1d.cuda and are loaded through kernels.dispatch only.
"""
from kernels.conv1d.naive import naive_causal_conv1d
from kernels.conv1d.torch import causal_conv1d, causal_conv1d_update

__all__ = ["causal_conv1d", "causal_conv1d_update", "naive_causal_conv1d"]
