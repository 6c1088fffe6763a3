"""Run kernels/{kda,gdn}/fla.py on CPU through the Triton interpreter (a test helper).

    python -m tests.kernels.fla_interpret CASE [CASE ...]

prints one JSON line {case: {"o": rel_err, "final": rel_err, "states": rel_err}}: the FLA
path against our torch path on the same inputs (varlen, GVA, initial state, checkpoints).
It must run in a fresh process: TRITON_INTERPRET is read when FLA defines its kernels. FLA picks
its device from `triton.runtime.driver.active`, which fails without a GPU, so FLA warns
"roll back to CPU" and runs its kernels on CPU tensors. Two shims make FLA's kernels run
under the interpreter:
  * autotune: keep only each kernel's first config (patched before FLA defines its kernels);
  * loop indices: the interpreter runs `for i in range(n)` with Python ints and some kernels
    call `i.to(tl.int64)`; FLA modules get a `range` whose items are ints with `.to()`.
"""
from __future__ import annotations

import builtins
import json
import os
import sys
import warnings

import torch

from tests.utils import rel_err


def make_inputs(lengths, scalar_gate, H=1, HV=2, K=16, V=16, g_min=-2.0, seed=0):
    """Small fp32 inputs in the contract's layout: (q, k, v, g, beta, initial_state, cu_seqlens);
    q and k L2-normalised, g a log decay uniform in [g_min, 0], beta in [0, 1]."""
    gen = torch.Generator().manual_seed(seed)
    T, N = sum(lengths), len(lengths)
    q, k = (torch.nn.functional.normalize(torch.randn(T, H, K, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(T, HV, V, generator=gen)
    g = torch.rand((T, HV) if scalar_gate else (T, HV, K), generator=gen) * g_min
    beta = torch.rand(T, HV, generator=gen)
    h0 = torch.randn(N, HV, K, V, generator=gen) * 0.1
    cu = torch.tensor([0] + list(lengths)).cumsum(0)
    return q, k, v, g, beta, h0, cu


def install_interpreter():
    """Set TRITON_INTERPRET and the two shims; must run before triton and FLA are imported."""
    if "triton" in sys.modules:
        raise RuntimeError("triton was imported before install_interpreter()")
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.runtime import autotuner, interpreter

    init = autotuner.Autotuner.__init__

    def first_config_only(self, fn, arg_names, configs, *args, **kwargs):
        init(self, fn, arg_names, configs[:1], *args, **kwargs)

    autotuner.Autotuner.__init__ = first_config_only

    class LoopIndex(int):
        """A Python int loop index that converts like a Triton scalar."""

        def to(self, dtype, **kwargs):
            return interpreter._implicit_cvt(int(self)).to(dtype, **kwargs)

    def loop_range(*args):
        return map(LoopIndex, builtins.range(*(a if isinstance(a, int) else int(a) for a in args)))

    warnings.filterwarnings("ignore", message="Triton is not supported on current platform")
    import fla.ops.gated_delta_rule  # noqa: F401
    import fla.ops.kda  # noqa: F401

    for name, module in list(sys.modules.items()):
        if name.startswith("fla.") and module is not None:
            module.range = loop_range


def cases():
    """case -> (FLA path, torch path, scalar gate, sequence lengths, checkpoint offsets per sequence)."""
    from kernels.gdn import chunk_gdn, recurrent_gdn
    from kernels.gdn.fla import fla_chunk_gdn, fla_recurrent_gdn
    from kernels.kda import chunk_kda, recurrent_kda
    from kernels.kda.fla import fla_chunk_kda, fla_recurrent_kda
    return {
        "kda_chunk": (fla_chunk_kda, chunk_kda, False, [100, 92], [[64], [64, 92]]),
        "kda_recurrent": (fla_recurrent_kda, recurrent_kda, False, [1, 1, 1], [[], [1], []]),
        "gdn_chunk": (fla_chunk_gdn, chunk_gdn, True, [100, 92], [[64], [64, 92]]),
        "gdn_recurrent": (fla_recurrent_gdn, recurrent_gdn, True, [1, 1, 1], [[], [1], []]),
        "kda_chunk_long": (fla_chunk_kda, chunk_kda, False, [256], [[64, 192]]),
        "gdn_chunk_long": (fla_chunk_gdn, chunk_gdn, True, [256], [[64, 192]]),
    }


def run_case(name):
    """Relative errors of the FLA path against the torch path for one case."""
    fla_fn, torch_fn, scalar_gate, lengths, offsets = cases()[name]
    q, k, v, g, beta, h0, cu = make_inputs(lengths, scalar_gate)
    ckpt = torch.tensor([int(cu[n]) + p for n, ps in enumerate(offsets) for p in ps], dtype=torch.int64)
    args = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu, checkpoint_at=ckpt)
    o, final, states = fla_fn(q, k, v, g, beta, **args)
    o_ref, final_ref, states_ref = torch_fn(q, k, v, g, beta, **args)
    errs = {"o": rel_err(o, o_ref), "final": rel_err(final, final_ref)}
    if len(ckpt):
        errs["states"] = rel_err(states, states_ref)
    return errs


if __name__ == "__main__":
    install_interpreter()
    print(json.dumps({name: run_case(name) for name in sys.argv[1:]}))
