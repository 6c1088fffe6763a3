"""The compiled CPU kernels, built on first use: paged decode attention and the delta-rule
decode step (attention/cpu_decode.cpp), paged prefill attention (attention/cpu_prefill.cpp),
the chunkwise delta-rule prefill of KDA and GDN (kda/cpu_chunk.cpp) and its inputs from a
layer's projections (kda/cpu_prepare.cpp), the Mamba2 SSD prefill
and decode step (mamba2/cpu_ssd.cpp), the causal conv1d prefill and decode step (conv1d/cpu_conv.cpp) and the
token routing of the padded mixture of experts (moe/cpu_moe.cpp), the RMS norms
(norm/cpu_norm.cpp) and the bf16 linears and gated experts over packed weights
(gemm/cpu_gemm.cpp); native.cpp binds them into one module (matmul.h: the small matmul they
share; denormal.h: denormals flushed to zero inside the kernels).

`torch.utils.cpp_extension` compiles it once per machine and source version (a few minutes;
cached under TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions/py3XX_cpu, in a folder
named by a hash of the sources' folder and contents, flags and torch version, so two checkouts
never rebuild each other's module) with the machine's own vector
instructions (-ffast-math at compile time only: vector exp and reassociated sums; the link
does not set the process's flush-to-zero mode, the kernels set it on their own threads while
they run). Where it cannot be built (no compiler, no
ninja) or HYBRIDSERVE_NATIVE=0, each function here returns None and its caller runs the torch
formulation, which computes the same. The kernels release the GIL while they run (they touch
no Python object), so the server's event loop streams outputs meanwhile.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)
EMPTY = torch.empty(0)  # "none" for the kernels' optional tensor arguments
HERE = Path(__file__).parent
SOURCES = [HERE / "native.cpp", HERE / "attention" / "cpu_decode.cpp", HERE / "attention" / "cpu_prefill.cpp",
           HERE / "kda" / "cpu_chunk.cpp", HERE / "kda" / "cpu_prepare.cpp", HERE / "mamba2" / "cpu_ssd.cpp",
           HERE / "conv1d" / "cpu_conv.cpp", HERE / "moe" / "cpu_moe.cpp", HERE / "norm" / "cpu_norm.cpp",
           HERE / "gemm" / "cpu_gemm.cpp"]
HEADERS = sorted(HERE.rglob("*.h"))  # every header under kernels/: the module's name follows them too
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp"]


def build_name() -> str:
    """The module's name: one per checkout (the build files name the sources by path) and
    version of the sources, flags and torch."""
    h = hashlib.sha256(" ".join(CFLAGS + [torch.__version__, str(HERE.resolve())]).encode())
    for p in SOURCES + HEADERS:
        h.update(p.read_bytes())
    return f"hybridserve_cpu_{h.hexdigest()[:12]}"


def build_directory(name: str) -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        py = f"py{sys.version_info.major}{sys.version_info.minor}"
        root = str(Path.home() / ".cache" / "torch_extensions" / f"{py}_cpu")
    return Path(root) / name


@contextlib.contextmanager
def build_lock(directory: Path):
    """Hold the folder for one build: an flock, which the kernel releases when its holder dies.
    torch's own lock is a file that a killed build leaves behind, and every later load would
    wait on it forever; under the flock no other build is live, so such a file is stale."""
    import fcntl

    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "build.flock", "w") as f:  # closing the file releases the flock
        fcntl.flock(f, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)
        yield


def use_ninja_package() -> None:
    """Put the ninja package's binary first on PATH. Another ninja on PATH (the system's, found
    when the venv is not activated) may be another version, which rejects the build log the
    other wrote and rebuilds every kernel (minutes) each time the two alternate."""
    try:
        import ninja
    except ImportError:
        if shutil.which("ninja") is None:
            raise RuntimeError("no ninja: pip install ninja") from None
        return
    path = os.environ.get("PATH", "")
    if not path.startswith(ninja.BIN_DIR + os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path


@functools.cache
def extension():
    """The built module, or None (the reason is logged once)."""
    if os.environ.get("HYBRIDSERVE_NATIVE", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        use_ninja_package()

        t0 = time.perf_counter()
        name = build_name()
        directory = build_directory(name)
        with build_lock(directory):
            module = load(name=name, sources=[str(p) for p in SOURCES], build_directory=str(directory),
                          extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"])
        log.info("CPU kernels ready in %.1f s (built once per machine, then loaded)",
                 time.perf_counter() - t0)
        return module
    except Exception as e:  # a missing compiler or ninja shows up as several exception types
        log.warning("CPU kernels not built (%s); using the torch path", e)
        return None


def paged_decode(q, k_cache, v_cache, page_table, lens, scale: float, dv: int) -> torch.Tensor | None:
    """o [N, H, Dv] fp32 for one query per sequence, or None where the kernel cannot run."""
    ext = extension() if q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) else None
    if ext is None:
        return None
    return ext.paged_decode(q, k_cache, v_cache, page_table, lens, scale, dv)


def paged_prefill(q, k_cache, v_cache, page_table, cu_seqlens, seq_lens, scale: float, dv: int) -> torch.Tensor | None:
    """o [T, H, Dv] fp32 of causal attention for packed query blocks over paged KV (queries at
    the end of each sequence's keys), or None where the kernel cannot run."""
    ok = q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)
    ok = ok and q.dtype == k_cache.dtype == v_cache.dtype
    ext = extension() if ok and k_cache.stride(-1) == v_cache.stride(-1) == 1 else None
    if ext is None:
        return None
    return ext.paged_prefill(q.contiguous(), k_cache, v_cache, page_table, cu_seqlens, seq_lens, scale, dv)


def delta_step(q, k, v, g, beta, state, slots, scale: float) -> torch.Tensor | None:
    """One delta-rule token per sequence, states updated in place in `state[slots]` (fp32, or bf16
    rounded after the step); o [N, HV, V] fp32, or None where the kernel cannot run (the caller
    gathers and steps)."""
    ext = extension() if state_in_place(state) else None
    if ext is None:
        return None
    f = [_f32(x) for x in (q, k, v, g, beta)]
    return ext.delta_step(*f, state, slots, scale)


def chunk_delta_rule(q, k, v, g, beta, state, cu_seqlens, checkpoints, scale: float, min_log_decay: float,
                     slots=EMPTY, fresh=EMPTY, checkpoint_slots=EMPTY, out=EMPTY):
    """The chunkwise delta rule (kernels/kda/chunk.py's contract) with `state` [N, HV, K, V] fp32
    advanced in place from each sequence's initial to its final state; checkpoints [C, 2] int64
    rows (sequence, tokens consumed). Returns (o [T, HV, V] fp32, states [C, HV, K, V]), or None
    where the kernel cannot run. With `slots` [N] int64, state is a pool [P, HV, K, V] (fp32, or bf16
    rounded after every 64 tokens; contiguous) and sequence n's state is its row slots[n], read and
    written in place (zeros first where `fresh` [N] bool); with `checkpoint_slots` [C] the checkpoints' states go into
    those rows of it instead of being returned (then states is empty). `out` [T, HV, V] fp32
    contiguous, where given, receives o (a row range of a round's output: models/layers/state.py)."""
    ext = extension() if q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) else None
    if ext is None:
        return None
    q, k, v = (x.to(q.dtype).contiguous() for x in (q, k, v))
    return ext.chunk_delta_rule_slots(q, k, v, _f32(g), _f32(beta), state, cu_seqlens, checkpoints, scale,
                                      min_log_decay, slots, fresh, checkpoint_slots, out)


def delta_prepare(x, h: int, k: int, hv: int, v: int, a, A_log, dt_bias, b, eps: float):
    """models/layers/state.py's delta_inputs in one pass per token: (q, k, v, g [T, HV, gK], beta), all
    fp32, or None where the kernel cannot run."""
    ok = _routable(x) and a.dtype == b.dtype == x.dtype and x.dim() == 2 and a.dim() == b.dim() == 3
    ok = ok and x.stride(1) == a.stride(2) == b.stride(2) == 1
    ext = extension() if ok else None
    if ext is None:
        return None
    return tuple(ext.delta_prepare(x, h, k, hv, v, a, _f32(A_log).view(-1), _f32(dt_bias).view(-1), b, eps))


def causal_conv1d(x, weight, bias, state, cu_seqlens, at_rows, silu: bool):
    """kernels/conv1d/torch.py's causal_conv1d with state [N, D, W-1] fp32 (initial conv states)
    and at_rows [C, 2] int64 (sequence, tokens consumed). Returns (y [T, D] in x's dtype,
    states [N + C, D, W-1] fp32: the final states, then those at at_rows), or None where the
    kernel cannot run."""
    ext = extension() if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) else None
    if ext is None:
        return None
    empty = weight.new_empty(0, dtype=torch.float32)
    return ext.causal_conv1d(_rows(x), _f32(weight), empty if bias is None else _f32(bias), state,
                             cu_seqlens, at_rows, silu)


def causal_conv1d_slots(x, weight, bias, state, slots, fresh, cu_seqlens, at_rows, checkpoint_slots,
                        silu: bool, out=EMPTY) -> torch.Tensor | None:
    """causal_conv1d with the conv states in a pool, read and written in place: state [P, D, W-1]
    (fp32 or bf16, contiguous), sequence n's initial state in row slots[n] (zeros where fresh[n])
    advanced there to its final state, the state at each row of at_rows written into row
    checkpoint_slots[i]. Returns y [T, D] in x's dtype (written into `out` where given: contiguous,
    as chunk_delta_rule's), or None where the kernel cannot run (nothing is written then)."""
    ok = x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
    ok = ok and state.dtype in (torch.float32, torch.bfloat16) and state.is_contiguous()
    ext = extension() if ok else None
    if ext is None:
        return None
    empty = weight.new_empty(0, dtype=torch.float32)
    return ext.causal_conv1d_slots(_rows(x), _f32(weight), empty if bias is None else _f32(bias), state, slots,
                                   fresh, cu_seqlens, at_rows, checkpoint_slots, silu, out)


def ssd_step(x, dt, A, B, C, D, state, slots) -> torch.Tensor | None:
    """One Mamba2 SSD token per sequence (kernels/mamba2/recurrent.py's rule) with the states
    advanced in place in `state[slots]` (fp32); y [N, H, P] fp32, or None where the kernel
    cannot run (the caller gathers and steps)."""
    ext = extension() if state.device.type == "cpu" and state.dtype == torch.float32 else None
    if ext is None:
        return None
    f = [_f32(t) for t in (x, dt, A, B, C)]
    return ext.ssd_step(*f, A.new_empty(0) if D is None else _f32(D), state, slots)


def conv_step(x, weight, bias, state, slots, silu: bool) -> torch.Tensor | None:
    """One causal-conv1d token per sequence (kernels/conv1d/torch.py's causal_conv1d_update) with
    the conv states advanced in place in `state[slots]` (fp32 or bf16); y [N, D] in x's dtype,
    or None where the kernel cannot run (the caller gathers and steps)."""
    ok = x.device.type == "cpu" and {x.dtype, state.dtype} <= {torch.float32, torch.bfloat16}
    ext = extension() if ok and state.is_contiguous() else None
    if ext is None:
        return None
    empty = weight.new_empty(0, dtype=torch.float32)
    return ext.conv_step(_rows(x), _f32(weight), empty if bias is None else _f32(bias),
                         state, slots, silu)


def delta_decode(qkv, conv_w, conv_state, state, slots, heads: tuple[int, int, int, int], a, A_log, dt_bias, b,
                 eps: float, gate, norm, dtype: torch.dtype) -> torch.Tensor | None:
    """A KDA / GDN layer's decode rows in one call (native.cpp): conv_step over qkv, delta_prepare,
    delta_step, then the gated output norm `norm` (GatedRMSNorm) with `gate` [T, HV, V], into
    `dtype` -- what those wrappers compute, with the states advanced in their slots; None where any
    of them would not run."""
    h, k, hv, v = heads
    ok = _routable(qkv) and qkv.dim() == 2 and qkv.stride(1) == 1 and a.dtype == b.dtype == qkv.dtype
    ok = ok and a.dim() == b.dim() == 3 and a.stride(2) == b.stride(2) == 1 and dtype in (torch.float32, torch.bfloat16)
    ok = ok and conv_state.is_contiguous() and conv_state.dtype in (torch.float32, torch.bfloat16)
    ok = ok and state_in_place(state) and _routable(gate) and gate.shape == (qkv.shape[0], hv, v)
    ext = extension() if ok else None
    if ext is None:
        return None
    return ext.delta_decode(_rows(qkv), _f32(conv_w), conv_state, state, slots, h, k, hv, v, a, _f32(A_log).view(-1),
                            _f32(dt_bias).view(-1), b, eps, k ** -0.5, _token_rows(gate), _f32(norm.weight), norm.eps,
                            norm.activation, dtype)


def attention_decode(q, k, v, k_cache, v_cache, kv_slots, page_table, seq_lens, scale: float, gate=None,
                     norms=None, cos=None, sin=None) -> torch.Tensor | None:
    """A GQA layer's decode rows in one call (native.cpp): with `norms` (the q and k RMSNorms) and
    cos, sin, rms_norm_rope of q and k; k and v written into their cache slots; paged_decode; with a
    gate, times sigmoid(gate): [T, H * D] in q's dtype, as those steps compute it one by one; None
    where one of them would not run."""
    ok = _routable(q) and q.dtype == k.dtype == v.dtype == k_cache.dtype == v_cache.dtype and q.dim() == k.dim() == 3
    ok = ok and k_cache.stride(-1) == v_cache.stride(-1) == 1 and (gate is None or gate.dtype == q.dtype)
    ok = ok and k.shape[1:] == k_cache.shape[2:] and v.shape[1:] == v_cache.shape[2:]
    if norms is not None:
        q_norm, k_norm = norms
        ok = ok and q.stride(-1) == k.stride(-1) == 1 and cos.dtype == sin.dtype == torch.float32
        ok = ok and (q_norm.eps, q_norm.offset) == (k_norm.eps, k_norm.offset)
    ext = extension() if ok else None
    if ext is None:
        return None
    # empty norm weights: no norm, no RoPE; an empty gate: none
    wq, wk, eps, offset, cos, sin = ((EMPTY, EMPTY, 0.0, 0.0, EMPTY, EMPTY) if norms is None else
                                     (_f32(q_norm.weight), _f32(k_norm.weight), q_norm.eps, q_norm.offset,
                                      _dense(cos), _dense(sin)))
    return ext.attention_decode(q, EMPTY if gate is None else gate, k, v, wq, wk, eps, offset, cos, sin, k_cache,
                                v_cache, kv_slots, page_table, seq_lens, scale)


def mamba_decode(xbc, conv_w, conv_b, conv_state, silu: bool, dt, dt_bias, dt_min: float, A_log, D, state, slots,
                 sizes: tuple[int, int, int, int], z, norm) -> torch.Tensor | None:
    """A Mamba2 layer's decode rows in one call (native.cpp): conv_step over the xBC rows, dt and A
    as models/nemotron_h.py forms them, ssd_step, then the silu(z)-gated grouped norm `norm`:
    [T, H * P] in z's dtype, the states advanced in their slots, as those steps compute it one by
    one; None where one of them would not run. sizes: (H, P, G, S)."""
    h, p, g, s = sizes
    ok = _routable(xbc) and xbc.dim() == 2 and conv_state.is_contiguous() and _routable(z)
    ok = ok and conv_state.dtype in (torch.float32, torch.bfloat16) and state.dtype == torch.float32
    ok = ok and z.shape == (xbc.shape[0], h * p) and (h * p) % norm.groups == 0
    ext = extension() if ok else None
    if ext is None:
        return None
    return ext.mamba_decode(_rows(xbc), _f32(conv_w), EMPTY if conv_b is None else _f32(conv_b), conv_state, silu, dt,
                            _f32(dt_bias), dt_min, _f32(A_log), EMPTY if D is None else _f32(D), state, slots, h, p, g,
                            s, _rows(z), _f32(norm.weight), norm.groups, norm.eps)


def mla_decode(q, c, k_rope, norm, cache, kv_slots, page_table, seq_lens, scale: float, w_uk, w_uv,
               key) -> torch.Tensor | None:
    """An absorbed MLA layer's decode rows in one call (native.cpp): the latent [norm(c) | k_rope]
    written into its cache slots, the queries q [T, H, nope + rope] absorbed through w_uk [H, r, nope],
    attention over the latent pages, then w_uv [H, vd, r]: [T, H * vd] in q's dtype, as
    models/kimi_linear.py's absorbed path computes it step by step with heads_bf16 (the weights
    packed as it packs them, views of `key`); None where one of its steps would not run that way."""
    rope, (h, r, nope), vd = k_rope.shape[-1], w_uk.shape, w_uv.shape[1]
    ok = q.device.type == "cpu" and q.dtype == c.dtype == k_rope.dtype == cache.dtype == key.dtype == torch.bfloat16
    ok = ok and norm.weight.dtype == c.dtype and not norm.offset and q.stride(-1) == 1 and c.stride(-1) == 1
    ok = ok and nope % 2 == 0 and r % 2 == 0 and cache.stride(-1) == 1 and cache.shape[2:] == (1, r + rope)
    ok = ok and q.shape[1:] == (h, nope + rope)
    ext = _bf16_gemm() if ok else None
    if ext is None:
        return None
    return ext.mla_decode(q, c, k_rope, _f32(norm.weight), norm.eps, cache, kv_slots, page_table, seq_lens, scale,
                          _heads_packed(ext, w_uk, key, "w_uk"), r, _heads_packed(ext, w_uv, key, "w_uv"), vd)


def rms_norm(x, weight, eps: float, offset: float = 0.0, cast_first: bool = False, gate=None,
             act: str = "", dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """models/layers/norm.py's norms in one pass: x / rms(x) in fp32, then times (offset + weight)
    and act(gate) (act "silu", "sigmoid" or "" for a plain gate), cast to `dtype` (x's dtype, or
    bf16 from fp32 x: the one rounding a cast of the fp32 output makes); with cast_first, cast to
    x's dtype first and times weight in that dtype. Rows of a 2-D x, and the gate's first dim,
    are read in place (any stride apart). None where the kernel cannot run."""
    dtype = x.dtype if dtype is None else dtype
    ok = _routable(x) and (gate is None or (_routable(gate) and gate.shape == x.shape))
    ext = extension() if ok and dtype in (x.dtype, torch.bfloat16) else None
    if ext is None:
        return None
    g = EMPTY if gate is None else _token_rows(gate) if gate.dim() > 1 else _dense(gate)
    return ext.rms_norm(_rows(x) if x.dim() == 2 else _dense(x), _f32(weight), eps, offset, cast_first, g, act, dtype)


def sigmoid_gate(o, gate) -> torch.Tensor | None:
    """o * sigmoid(gate) in one pass, each step rounded as torch's ops in o's dtype round it (the
    same bits in bf16): o [T, C], gate [T, C] of o's dtype (its rows may be any stride apart: read
    in place from a projection's output). None where the kernel cannot run."""
    ok = _routable(o) and o.dim() == 2 and gate.dtype == o.dtype and gate.shape == o.shape
    ext = extension() if ok else None
    return None if ext is None else ext.sigmoid_gate(_dense(o), _rows(gate))


def relu2(x) -> torch.Tensor | None:
    """relu(x)^2 in one pass, rounded as F.relu then square_ round it in x's dtype (the same bits);
    None where the kernel cannot run."""
    ext = extension() if _routable(x) else None
    return None if ext is None else ext.relu2(_dense(x))


def gated_group_norm(x, z, weight, groups: int, eps: float) -> torch.Tensor | None:
    """models/nemotron_h.py's gated norm in one pass: w * norm(x * silu(z)) for x, z [T, D] (z may be
    a column range), the RMS over each of `groups` channel groups, in fp32, cast to z's dtype;
    None where the kernel cannot run."""
    ok = _routable(x) and _routable(z) and z.shape == x.shape and x.dim() == 2 and x.shape[-1] % groups == 0
    ext = extension() if ok else None
    return None if ext is None else ext.gated_group_norm(_dense(x), _rows(z), _f32(weight), groups, eps)


def add_rms_norm(x, residual, weight, eps: float, offset: float, cast_first: bool) -> tuple | None:
    """(rms_norm(x + residual), x + residual) in one pass, the sum rounded to x's dtype as torch's
    add rounds it; None where the kernel cannot run."""
    ok = _routable(x) and residual.dtype == x.dtype and residual.shape == x.shape
    ext = extension() if ok else None
    if ext is None:
        return None
    return ext.add_rms_norm(_dense(x), _dense(residual), _f32(weight), eps, offset, cast_first)


def rms_norm_rope(x, weight, eps: float, offset: float, cos, sin) -> torch.Tensor | None:
    """models/qwen3_next.py's q / k norm and RoPE in one pass: x [T, heads, D] (unit stride in D),
    cos and sin [T, rot] fp32 -> [T, heads, D] contiguous in x's dtype; None where the kernel
    cannot run."""
    ok = _routable(x) and x.dim() == 3 and x.stride(2) == 1 and cos.dtype == sin.dtype == torch.float32
    ext = extension() if ok else None
    return None if ext is None else ext.rms_norm_rope(x, _f32(weight), eps, offset, _dense(cos), _dense(sin))


def topk_softmax(logits, k: int, renorm: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Softmax routing in one pass: (weights [T, k] fp32, experts [T, k] int64), the largest
    first, renormalised to sum 1 with `renorm`; None where the kernel cannot run."""
    ok = _routable(logits) and logits.dim() == 2 and logits.stride(1) == 1
    ext = extension() if ok else None
    return None if ext is None else ext.topk_softmax(logits, k, renorm)


def topk_scores(scores, bias, k: int, renorm: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One-group routing by biased scores in one pass (models/layers/mlp.py's GroupedTopKRouter):
    (weights [T, k] fp32, experts [T, k] int64) for fp32 scores [T, E], the experts chosen by
    score + bias, weighted by score; None where the kernel cannot run."""
    ok = scores.device.type == "cpu" and scores.dtype == torch.float32 and scores.dim() == 2
    ext = extension() if ok and scores.stride(1) == 1 else None
    return None if ext is None else ext.topk_scores(scores, _f32(bias), k, renorm, scaling)


def router_logits(x, weight) -> torch.Tensor | None:
    """F.linear(x.float(), weight.float()) for a router: x [T, D] (fp32 or bf16) and weight [E, D],
    each logit one fp32 sum of exact products over D (moe/cpu_moe.cpp); None where the kernel
    cannot run (the caller uses torch)."""
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    ext = extension() if _routable(x) and x.dim() == 2 and not grad else None
    return None if ext is None else ext.router_logits(_rows(x), _f32(weight))


def _f32(t: torch.Tensor) -> torch.Tensor:
    """t as contiguous fp32; t itself when it already is (no op dispatched: these wrappers run
    hundreds of times a decode step). The copy of a parameter or of a view of one (a bf16 norm
    weight; a conv weight's `[:, 0]`, made anew by every forward) is made once and kept while the
    parameter is unchanged."""
    if t.dtype == torch.float32 and t.is_contiguous():
        return t
    base = t if isinstance(t, torch.nn.Parameter) else t._base
    if not isinstance(base, torch.nn.Parameter):
        return t.float().contiguous()
    copies = _packed(base, dict, FP32)  # this version's copies, one per view
    view = (t.storage_offset(), tuple(t.shape), t.stride())
    if (out := copies.get(view)) is None:
        out = copies[view] = t.detach().float().contiguous()
    return out


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t [R, C] as the kernels read rows: unit stride in C, rows any stride apart (a column range
    of a wider projection is read in place), not overlapping."""
    return t if t.stride(-1) == 1 and t.stride(0) >= t.shape[-1] else t.contiguous()


def _token_rows(t: torch.Tensor) -> torch.Tensor:
    """t [T, ...] with each t[i] contiguous and the T rows any stride apart (not overlapping): the
    gate of rms_norm read in place from a column range of a projection's output."""
    inner = t.shape[1:].numel()
    ok = t.shape[0] > 0 and t.stride(-1) == 1 and t.stride(0) >= inner and t[0].is_contiguous()
    return t if ok else t.contiguous()


def state_in_place(state: torch.Tensor) -> bool:
    """Whether the delta-rule kernels read and write this recurrent-state pool in place: CPU, contiguous,
    fp32 or bf16 (worked on in fp32, rounded to bf16 after every 64-token prefill step and every decode
    token)."""
    return state.device.type == "cpu" and state.dtype in (torch.float32, torch.bfloat16) and state.is_contiguous()


def _routable(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype in (torch.float32, torch.bfloat16)


def moe_dispatch(x, idx, counts, cap: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(padded [E, cap, D] in x's dtype, at [T * k] int64) as models/layers/mlp.py's torch
    routing makes them (expert e's rows in (token, choice) order, then zeros; at: the row of
    padded.view(E * cap, D) of each (token, choice)), or None where the kernel cannot run."""
    ext = extension() if _routable(x) else None
    return None if ext is None else ext.moe_dispatch(x.contiguous(), idx, counts, cap)


def moe_combine(y, at, weight) -> torch.Tensor | None:
    """sum over c of weight[t, c] * y[at[t * k + c]] -> [T, D] in y's dtype with the torch path's
    roundings, or None where the kernel cannot run."""
    ext = extension() if _routable(y) and weight.dtype == y.dtype else None
    return None if ext is None else ext.moe_combine(y.contiguous(), at, weight)


def chunk_ssd(x, dt, A, B, C, D, state, cu_seqlens, checkpoints, chunk_size: int, slots=EMPTY, fresh=EMPTY,
              checkpoint_slots=EMPTY, out=EMPTY, gate=None):
    """kernels/mamba2/chunk.py's chunk_ssd with `state` [N, H, P, S] fp32 advanced in place from
    the initial to the final states; checkpoints [C, 2] int64 rows (sequence, tokens consumed).
    Returns (y [T, H, P] in x's dtype, states [C, H, P, S]), or None where the kernel cannot run.
    `slots`, `fresh`, `checkpoint_slots` and `out`: as chunk_delta_rule's. x, B and C are read in
    place where each token's heads (groups) are contiguous: column ranges of the conv output.
    `gate` = (z [T, H * P], weight [H * P], groups, eps), all fp32 with x: y comes back normed as
    gated_group_norm(y, z, weight, groups, eps) would give it (the same bits), each chunk normed
    while in cache; None where the kernel cannot run so (nothing is written then)."""
    ext = extension() if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) else None
    if ext is None:
        return None
    z, weight, groups, eps = EMPTY, EMPTY, 1, 0.0
    if gate is not None:
        z, weight, groups, eps = gate
        if not (x.dtype == z.dtype == torch.float32 and z.dim() == 2 and _routable(z)):
            return None
        z, weight = _rows(z), _f32(weight)
    x, B, C = (_token_heads(t.to(x.dtype)) for t in (x, B, C))
    empty = A.new_empty(0, dtype=torch.float32)
    return ext.chunk_ssd_slots(x, dt.float().contiguous(), A.float().contiguous(), B, C,
                               empty if D is None else D.float(), state, cu_seqlens, checkpoints, chunk_size, slots,
                               fresh, checkpoint_slots, out, z, weight, groups, eps)


def out_rows(out: torch.Tensor | None, shape, dtype: torch.dtype) -> torch.Tensor:
    """`out` where a kernel can write its output of `shape` and `dtype` into it (a contiguous row
    range of a round's output), else EMPTY: the kernel makes its own."""
    if out is None or out.shape != shape or out.dtype != dtype or not out.is_contiguous() or not out.numel():
        return EMPTY
    return out


def _token_heads(t: torch.Tensor) -> torch.Tensor:
    """t [T, H, D] as chunk_ssd reads it: each token's [H, D] contiguous, the tokens any stride apart
    (not overlapping)."""
    T, H, D = t.shape
    ok = t.stride(2) == 1 and (H == 1 or t.stride(1) == D) and (T <= 1 or t.stride(0) >= H * D)
    return t if ok else t.contiguous()


# packed weights by id of the tensor they were packed from (dropped when it goes), valid while
# its storage and version counter are those it was packed at (a load in place or a .to()
# makes it pack anew); tensors compare elementwise, so they cannot be dictionary keys
PACKED: dict[int, tuple] = {}
FP32: dict[int, tuple] = {}  # fp32 copies of parameters (_f32), kept the same way


def _bf16_gemm() -> Any:
    ext = extension()
    return ext if ext is not None and _bf16_gemm_supported(ext) else None


@functools.cache
def _bf16_gemm_supported(ext) -> bool:
    return bool(ext.gemm_bf16_supported())


def assert_torch_bf16_bits(ours: torch.Tensor, torch_out: torch.Tensor) -> None:
    """The bf16 gemm kernels' contract with torch's bf16 matmul: oneDNN's micro-kernels (AMX)
    give its bits; our own (AVX-512 BF16 or AVX2) sum over K in their own order, within one
    bf16 step of it."""
    ext = _bf16_gemm()
    if ext is not None and ext.gemm_bf16_onednn():
        assert torch.equal(ours, torch_out), "not torch's bits"
    else:
        torch.testing.assert_close(ours, torch_out, rtol=2**-7, atol=1e-5)


def _packed(key: torch.Tensor, pack, cache: dict | None = None, also: tuple[torch.Tensor, ...] = ()):
    """pack() made once per version of key and of the tensors `also` packed with it (remade when one
    is written in place or replaced), in cache."""
    cache = PACKED if cache is None else cache
    # inference tensors keep no version
    stamp = tuple((t.data_ptr(), 0 if t.is_inference() else t._version) for t in (key, *also))
    entry = cache.get(id(key))
    if entry is None:
        weakref.finalize(key, cache.pop, id(key), None)
    if entry is None or entry[0] != stamp:
        entry = cache[id(key)] = (stamp, pack())
    return entry[1]


def linear_bf16(x, weight, bias=None) -> torch.Tensor | None:
    """F.linear(x, weight, bias) for bf16 x [..., K] and weight [N, K] on CPU through the packed
    micro-kernels of gemm/cpu_gemm.cpp (the weight packed on first use), or None where they
    cannot run (another dtype or device, odd K, autograd, or a CPU with neither AMX nor AVX2:
    then torch's matmul)."""
    ok = x.dtype == weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0
    ext = _bf16_gemm() if ok and _plain(x, weight) else None
    return None if ext is None else _linear(ext.linear_bf16, x, _packed(weight, lambda: ext.pack_bf16(weight)),
                                           weight.shape[0], bias)


def linear_f32(x, weight, bias=None) -> torch.Tensor | None:
    """F.linear(x, weight, bias) for fp32 x [..., K] and weight [N, K] through gemm/cpu_gemm.cpp's
    fp32 micro-kernel (the weight packed on first use; each output summed over K in order, the same
    whatever rows share the call), or None where it does not run (another dtype or device,
    autograd, or a CPU with AMX, or AVX-512 without BF16, or neither AVX-512 BF16 nor AVX2: then
    torch's matmul, MKL's sgemm)."""
    ext = extension() if x.dtype == weight.dtype == torch.float32 and _plain(x, weight) else None
    if ext is None or not _f32_gemm_supported(ext):
        return None
    return _linear(ext.linear_f32, x, _packed(weight, lambda: ext.pack_f32(weight)), weight.shape[0], bias)


_FP32_PATH = {"path": "ours"}  # fp32_matmul's setting


@contextlib.contextmanager
def fp32_matmul(path: str):
    """Inside: fp32 projections and experts through `path`, "ours" (linear_f32 and moe_f32 where
    this CPU runs them; the default) or "torch" (both return None, so their callers take torch's
    matmul and the torch experts path, as on a CPU without the micro-kernel): the two compared
    in one process (benchmarks/peers.py --fp32-path)."""
    if path not in ("ours", "torch"):
        raise ValueError(f"fp32_matmul: path {path!r}: 'ours' or 'torch'")
    old, _FP32_PATH["path"] = _FP32_PATH["path"], path
    try:
        yield
    finally:
        _FP32_PATH["path"] = old


def fp32_micro_kernel() -> bool:
    """Whether linear_f32 and moe_f32 run here and now: built for this CPU, and not turned off by
    fp32_matmul("torch")."""
    ext = extension()
    return ext is not None and _f32_gemm_supported(ext)


def _f32_gemm_supported(ext) -> bool:
    return _FP32_PATH["path"] == "ours" and _f32_gemm_built(ext)


@functools.cache
def _f32_gemm_built(ext) -> bool:
    return bool(ext.gemm_f32_supported())


def _plain(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """On CPU, unit stride along K, and no autograd (the packed kernels compute no gradients)."""
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return x.device.type == "cpu" and weight.stride(1) == 1 and not grad


def _linear(kernel, x: torch.Tensor, packed: torch.Tensor, n: int, bias) -> torch.Tensor:
    b = EMPTY if bias is None else _f32(bias)
    if x.dim() == 2:  # rows read in place (e.g. a column range of a fused projection's output)
        return kernel(_rows(x), packed, n, b)
    return kernel(_dense(x.reshape(-1, x.shape[-1])), packed, n, b).view(*x.shape[:-1], n)


HEAD_PACKS: dict[str, dict] = {}  # heads_bf16's packed weights, one cache per tag


def heads_bf16(x, weight, out, key=None, tag: str = "") -> bool:
    """out[t, h, :N] = x[t, h] @ weight[h]^T for bf16 x [T, H, K] and weight [H, N, K] on CPU
    through the packed micro-kernels (fp32 sums rounded once, as linear_bf16), written into out
    [T, H, >= N] (a view, e.g. the first N channels of a wider tensor). The weight is packed once
    per version of `key` (default: weight itself; a parameter the per-call view `weight` is made
    from, with a `tag` per view). False where the kernels cannot run (the caller uses torch)."""
    ok = x.device.type == "cpu" and x.dtype == weight.dtype == out.dtype == torch.bfloat16
    ok = ok and weight.shape[2] % 2 == 0 and x.stride(-1) == 1 and out.stride(-1) == 1
    ok = ok and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ext = _bf16_gemm() if ok else None
    if ext is None:
        return False
    ext.heads_bf16(x, _heads_packed(ext, weight, key, tag), weight.shape[1], out)
    return True


def _heads_packed(ext, weight, key, tag: str) -> torch.Tensor:
    """weight [H, N, K] packed for heads_bf16, once per version of `key` (None: weight) and `tag`."""
    return _packed(weight if key is None else key, lambda: ext.pack_heads_bf16(weight.contiguous()),
                   HEAD_PACKS.setdefault(tag, {}))


def _experts_kernel(dtype: torch.dtype) -> tuple[Any, str]:
    """The extension and the suffix of its experts kernels ("bf16" or "f32") for this dtype on
    this CPU, or (None, "") where neither runs."""
    if dtype == torch.bfloat16:
        return _bf16_gemm(), "bf16"
    ext = extension() if dtype == torch.float32 else None
    return (ext, "f32") if ext is not None and _f32_gemm_supported(ext) else (None, "")


def moe_runs(x: torch.Tensor) -> bool:
    """Whether moe() can run for x's dtype and device on this CPU (callers stack the experts'
    weights for it only then)."""
    grad = torch.is_grad_enabled() and x.requires_grad
    return x.device.type == "cpu" and not grad and _experts_kernel(x.dtype)[0] is not None


def _experts(x, gate_up, down, shared) -> tuple[Any, str, tuple[torch.Tensor, ...]] | None:
    """(extension, "bf16" or "f32", (gate_up, down, shared gate_up, shared down) packed) for the
    compiled experts call on x [T, D] with the experts' stacks gate_up [E, 2I, D], down [E, D, I] and
    shared = (gate_up [2I', D], down [D, I']) or None; None where the call cannot run them."""
    dt = x.dtype
    ok = x.device.type == "cpu" and dt == gate_up.dtype == down.dtype
    ok = ok and (shared is None or all(t.dtype == dt and t.stride(-1) == 1 for t in shared))
    pairs = [x.shape[1], down.shape[2], *(() if shared is None else (shared[1].shape[1],))]
    ok = ok and (dt != torch.bfloat16 or all(n % 2 == 0 for n in pairs))  # bf16: VNNI pairs, even D and I
    ext, kind = _experts_kernel(dt) if ok else (None, "")
    if ext is None:
        return None
    pack = getattr(ext, f"pack_experts_{kind}")
    gu, dn = _packed(gate_up, lambda: pack(gate_up, down), also=(down,))
    sgu, sdn = (EMPTY, EMPTY) if shared is None else \
        _packed(shared[0], lambda: pack(shared[0][None], shared[1][None]), also=(shared[1],))
    return ext, kind, (gu, dn, sgu, sdn)


def softmax_moe(x, router, k: int, renorm: bool, gate_up, down, shared) -> torch.Tensor | None:
    """models/qwen3_next.py's SparseMoE in one call (native.cpp): x [T, D] through `router` [E + 1, D]
    (the router's E rows, then the shared expert's gate), softmax top-k of the first E outputs
    (renormalised with `renorm`), sigmoid of the last, then the experts' stacks gate_up [E, 2I, D]
    and down [E, D, I] with the shared expert shared = (gate_up [2I', D], down [D, I']) scaled by
    it: the kernels linear, topk_softmax and moe run one by one, so their bits; None where one of
    them would not run that way (the caller takes the steps)."""
    grad = torch.is_grad_enabled() and (x.requires_grad or router.requires_grad)
    ok = x.dim() == 2 and x.is_contiguous() and not grad and router.dtype == x.dtype and router.stride(1) == 1
    found = _experts(x, gate_up, down, shared) if ok else None
    if found is None:
        return None
    ext, kind, packed = found
    pack = getattr(ext, f"pack_{kind}")
    return ext.softmax_moe(x, _packed(router, lambda: pack(router)), router.shape[0] - 1, k, renorm, *packed)


def scores_moe(x, router, bias, k: int, renorm: bool, scaling: float, gate_up, down, shared) -> torch.Tensor | None:
    """models/kimi_linear.py's KimiMoE in one call (native.cpp), one expert group: router_logits of
    x [T, D] against `router` [E, D], their sigmoid, topk_scores with the correction `bias` [E],
    then the experts as softmax_moe runs them, the shared expert (or none) unscaled: the kernels
    one by one, so their bits; None where one of them would not run that way."""
    grad = torch.is_grad_enabled() and (x.requires_grad or router.requires_grad)
    ok = x.dim() == 2 and x.is_contiguous() and not grad
    found = _experts(x, gate_up, down, shared) if ok else None
    if found is None:
        return None
    ext, _, packed = found
    return ext.scores_moe(x, _f32(router), _f32(bias), k, renorm, scaling, *packed)


def moe(x, idx, weight, gate_up, down, act: str, shared=None, scale=None) -> torch.Tensor | None:
    """models/layers/mlp.py's run_experts for gated experts without biases on CPU (x [T, D], idx
    and weight [T, k], the experts' stacks gate_up [E, 2I, D] and down [E, D, I]) in one call: bf16
    with the torch path's roundings (moe_bf16), fp32 within fp32 rounding of it (moe_f32, where
    linear_f32 runs); with shared = (gate_up [2I', D], down [D, I']) a shared expert every token
    runs, its output times scale [T, 1] (or 1) added in the same pass; None where the kernel
    cannot run."""
    ok = act == "silu" and (scale is None or (scale.dtype == x.dtype and scale.numel() == x.shape[0]))
    found = _experts(x, gate_up, down, shared) if ok else None
    if found is None:
        return None
    ext, kind, (gu, dn, sgu, sdn) = found
    return getattr(ext, f"moe_{kind}")(x.contiguous(), idx, weight.to(x.dtype), gu, dn, act, sgu, sdn,
                                       EMPTY if scale is None else _dense(scale))
