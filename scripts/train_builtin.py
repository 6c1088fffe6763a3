"""Train the built-in model (models.builtin.CONFIG, unchanged) on the Python standard library.

The shipped weights in models/weights/builtin/ come from exactly this command, on a 2-core
x86 CPU (AMD EPYC) with torch 2.13.0 (CPU build) and transformers 5.24.0:

    .venv/bin/python scripts/train_builtin.py --steps 1200

The budget is the step count: 1,200 steps of 8 x 256 bytes take about 26 minutes on the idle
2-core machine (~1.3 s/step). `--minutes` (default 60) only stops a run that is too slow,
saying so; the shipped run was slowed by another job holding one of the two cores (2.2 s/step,
44 minutes of training) and was started with `--minutes 150`, which changes nothing else.

Data: the `.py` files under `sysconfig.get_paths()["stdlib"]` of the Python that runs this
script (CPython 3.11.7 for the shipped weights), in sorted path order, EXCEPT
  - anything under the folders site-packages/, test/, tests/, idlelib/, lib2to3/, turtledemo/,
    encodings/ (codec tables), pydoc_data/ (one 750 kB string of help text) and __pycache__/;
  - the generated data files html/entities.py and _sysconfigdata_*.py.
Of those, the files named in VALIDATION (below) are held out for the validation loss; all
the others are the training set. Each file is read as UTF-8 text, encoded with
`models.builtin.ByteTokenizer` (token = byte 0..255) and wrapped as BOS + bytes + EOS; the
training files are concatenated into one stream in sorted order.

Training: transformers' KimiLinearForCausalLM on its pure-torch path, with FLA /
causal-conv1d hidden from it, fp32, 2 threads (its save_pretrained writes the checkpoint
names our loader expects). Its reference `chunk_kimi_delta_attention` is exact but slow for
backward on CPU (a 64 x 64 x 64 pairwise decay tensor per chunk and a 63-step Python loop),
so it is replaced by `chunk_kda` below: the same chunked delta rule (chunks of 16: a WY form
via a unit-triangular solve, then the chunk recurrence of the state), whose within-chunk
decays exp(G_i - G_j) are exact pairwise products in 4 x 4 diagonal sub-blocks and, below
them, one matmul per sub-block through the reference point r between i and j:
exp(G_i - G_r) * exp(G_r - G_j), both factors <= 1, so nothing overflows, forward or backward,
however strong the learnt decays. It matches the reference to fp32 rounding, outputs, states
and gradients (checked at start, also with decays down to exp(-2000)). The forget gate's
softplus is the engine's (F.softplus, threshold 20: same values, no NaN gradients).

Each step draws `--batch` windows of `--seq + 1` tokens from the stream, each starting at the
beginning of a uniformly drawn line (a seeded torch.Generator), so that a context starts at
column 0 as a prompt does (with windows at arbitrary byte offsets the model learnt that its
first bytes are mid-line, indented deeper, and after `def f(n):\n    ` greedily kept adding
spaces); AdamW (betas 0.9/0.95, weight decay 0.1 on matrices),
linear warmup then cosine decay to 10 %, gradient clipping at 1.0. The MoE routers use the
auxiliary-loss-free balancing of DeepSeek-V3: after each step each router's
e_score_correction_bias moves by --bias-rate towards equal expert loads (it only affects
which experts are picked, not their weights). Weights are initialised as transformers does
(normal 0.02; A_log = log U(1, 16); dt_bias = softplus^-1 of dt ~ logU(1e-3, 1e-1), the
same rule as models.builtin.write_builtin). With the same seed, torch version and
thread count the run is deterministic.

The result is written in bfloat16 (config.json as KimiLinearConfig(**CONFIG).save_pretrained
writes it, plus model.safetensors), loaded back with models.loader.load_model and evaluated
once more in that form (the loader casts to the config's float32).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# transformers binds FLA / causal-conv1d / mamba-ssm kernels at import time when they import;
# FLA imports on CPU but its Triton kernels cannot run here. Hide them from this process.
for _name in ("fla", "causal_conv1d", "mamba_ssm"):
    for _mod in [m for m in sys.modules if m == _name or m.startswith(_name + ".")]:
        del sys.modules[_mod]
    sys.modules[_name] = None  # `import fla` raises ImportError

# Sleep rather than spin while waiting at OpenMP barriers: on a shared 2-core machine spinning
# threads slow every step many times over; the results do not depend on it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from models.builtin import BOS, CONFIG, EOS, ByteTokenizer  # noqa: E402

EXCLUDE_DIRS = {"site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "encodings", "pydoc_data",
                "__pycache__"}
EXCLUDE_FILES = {"html/entities.py"}
VALIDATION = ("bisect.py", "colorsys.py", "fnmatch.py", "heapq.py", "shlex.py", "textwrap.py")


# -- data -----------------------------------------------------------------------------------

def source_files(stdlib: Path) -> list[Path]:
    """The stdlib .py files used (training + validation), in sorted order of their relative path."""
    out = []
    for p in sorted(stdlib.rglob("*.py"), key=lambda p: p.relative_to(stdlib).as_posix()):
        rel = p.relative_to(stdlib)
        if set(rel.parts[:-1]) & EXCLUDE_DIRS or rel.as_posix() in EXCLUDE_FILES:
            continue
        if rel.name.startswith("_sysconfigdata_"):
            continue
        out.append(p)
    return out


def encode_files(files: list[Path], tok: ByteTokenizer) -> torch.Tensor:
    ids: list[int] = []
    for p in files:
        ids += [BOS, *tok.encode(p.read_text(encoding="utf-8")), EOS]
    return torch.tensor(ids, dtype=torch.int16)


def load_data(stdlib: Path):
    tok = ByteTokenizer()
    files = source_files(stdlib)
    val = [p for p in files if p.relative_to(stdlib).as_posix() in VALIDATION]
    train = [p for p in files if p not in val]
    assert len(val) == len(VALIDATION), f"validation files missing from {stdlib}"
    return train, val, encode_files(train, tok), encode_files(val, tok)


# -- fast differentiable KDA (same function as transformers' chunk_kimi_delta_attention) -------

def _l2norm(x, eps=1e-6):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def chunk_kda(query, key, value, g, beta, chunk_size=16, sub_size=4, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, **kwargs):
    """KDA over [B, T, H, D] inputs (g: log decays per channel, beta: [B, T, H]); returns
    (output [B, T, H, V], final state [B, H, K, V] or None). Every exp() here has an argument
    <= 0 (or -inf), so nothing overflows, forward or backward, however strong the decays."""
    dtype = query.dtype
    q, k, v, g = (x.transpose(1, 2).float() for x in (query, key, value, g))  # [B, H, T, D]
    beta = beta.transpose(1, 2).float()
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    B, H, T, K = k.shape
    V = v.shape[-1]
    C, s = chunk_size, sub_size
    M = C // s
    assert C % s == 0 and M >= 2
    pad = (C - T % C) % C
    q = F.pad(q, (0, 0, 0, pad)) * K ** -0.5
    k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (k, v, g))
    beta = F.pad(beta, (0, pad))
    N = (T + pad) // C
    q, k, v, g = (x.reshape(B, H, N, C, -1) for x in (q, k, v, g))
    beta = beta.reshape(B, H, N, C, 1)
    G = g.cumsum(-2)  # within-chunk cumulative log decay, non-increasing
    dev = q.device
    # Within-chunk scores [i, j] = x_i . k_j * exp(G_i - G_j) for x = q (j <= i) and x = k (j < i),
    # built per sub-block of s rows: (1) the diagonal s x s blocks exactly, pairwise over K;
    qs, ks, Gs = (x.view(B, H, N, M, s, K) for x in (q, k, G))
    low = torch.tril(torch.ones(s, s, dtype=torch.bool, device=dev))
    d = (Gs.unsqueeze(-2) - Gs.unsqueeze(-3)).masked_fill(~low[..., None], float("-inf")).exp()
    diag_k = (ks.unsqueeze(-2) * ks.unsqueeze(-3) * d).sum(-1)  # [B, H, N, M, s, s]
    diag_q = (qs.unsqueeze(-2) * ks.unsqueeze(-3) * d).sum(-1)
    # (2) rows of sub-block a >= 1 against all earlier columns j < a*s, as one matmul through the
    # reference r = a*s - 1 between them: exp(G_i - G_j) = exp(G_i - G_r) * exp(G_r - G_j), both <= 1.
    Gr = G[:, :, :, s - 1:C - 1:s].unsqueeze(-2)  # [B, H, N, M-1, 1, K]
    before = torch.arange(C, device=dev)[None, :] < torch.arange(1, M, device=dev)[:, None] * s  # [M-1, C]
    kr = k.unsqueeze(3) * (Gr - G.unsqueeze(3)).masked_fill(~before[..., None], float("-inf")).exp()
    er = (Gs[:, :, :, 1:] - Gr).exp()  # [B, H, N, M-1, s, K]
    zero = q.new_zeros(B, H, N, 1, s, C)
    off_q = torch.cat([zero, (qs[:, :, :, 1:] * er) @ kr.transpose(-1, -2)], 3)  # [B, H, N, M, s, C]
    off_k = torch.cat([zero, (ks[:, :, :, 1:] * er) @ kr.transpose(-1, -2)], 3)
    eye = torch.eye(M, device=dev).view(M, 1, M, 1)
    qk = (off_q + (diag_q.unsqueeze(-2) * eye).reshape(B, H, N, M, s, C)).reshape(B, H, N, C, C)
    kk = (off_k + (diag_k.unsqueeze(-2) * eye).reshape(B, H, N, M, s, C)).reshape(B, H, N, C, C)
    strict = torch.tril(torch.ones(C, C, dtype=torch.bool, device=dev), -1)
    # WY form: (I + strict(beta k k^T decay)) [u | w] = [beta v | beta k exp(G)]
    A = torch.eye(C, device=dev) + beta * kk.masked_fill(~strict, 0)
    Ge = G.exp()
    sol = torch.linalg.solve_triangular(A, torch.cat([v * beta, k * beta * Ge], -1), upper=False,
                                        unitriangular=True)
    u, w = sol[..., :V], sol[..., V:]
    qg = q * Ge
    glast = G[:, :, :, -1:]
    kd = (k * (glast - G).exp()).transpose(-1, -2)
    dec = glast.transpose(-1, -2).exp()
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float()
    outs = []
    for n in range(N):  # the chunk recurrence of the state S [B, H, K, V]
        vn = u[:, :, n] - w[:, :, n] @ S
        outs.append(qg[:, :, n] @ S + qk[:, :, n] @ vn)
        S = S * dec[:, :, n] + kd[:, :, n] @ vn
    o = torch.stack(outs, 2).reshape(B, H, N * C, V)[:, :, :T].transpose(1, 2).contiguous().to(dtype)
    return o, (S if output_final_state else None)


def forget_gate_forward(self, hidden_states):
    """transformers' KimiLinearForgetGate.forward with F.softplus (as the engine computes it)."""
    shape = (*hidden_states.shape[:2], -1, self.head_dim)
    g = (self.f_b_proj(self.f_a_proj(hidden_states)).float() + self.dt_bias.float().view(1, 1, -1)).view(shape)
    return -self.A_log.float().exp() * F.softplus(g, threshold=20.0)


def import_reference():
    from transformers.models.kimi_linear import modeling_kimi_linear as hf

    return hf


def check_kda(hf, chunk_size: int, sub_size: int) -> float:
    """Largest relative error of chunk_kda's output, final state and input gradients vs
    transformers' torch reference, with mild decays and with a few steps of extreme decay."""
    gen = torch.Generator().manual_seed(0)
    B, T, H, D = 2, 77, 2, 32
    q, k, v = (torch.randn(B, T, H, D, generator=gen) for _ in range(3))
    g = -torch.rand(B, T, H, D, generator=gen) * 2
    beta = torch.rand(B, T, H, generator=gen)
    s0 = torch.randn(B, H, D, D, generator=gen)
    w = torch.randn(B, T, H, D, generator=gen)
    g_extreme = g.clone()
    g_extreme[0, 5:40, 0] *= 60  # decays to exp(-2000) within a chunk

    def run(fn, g, **kw):
        xs = [t.clone().requires_grad_() for t in (q, k, v, g, beta, s0)]
        out, s = fn(*xs[:5], initial_state=xs[5], output_final_state=True, use_qk_l2norm_in_kernel=True, **kw)
        ((out * w).sum() + s.sum()).backward()
        return [out, s, *(x.grad for x in xs)]

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    err = 0.0
    for gg in (g, g_extreme, g * 30):
        ref = run(hf.chunk_kimi_delta_attention, gg)
        ours = run(chunk_kda, gg, chunk_size=chunk_size, sub_size=sub_size)
        assert all(torch.isfinite(t).all() for t in ours)
        err = max(err, *(rel(a, b) for a, b in zip(ours, ref)))
    return err


def build_model(seed: int, chunk_size: int, sub_size: int):
    from transformers import KimiLinearConfig

    hf = import_reference()
    err = check_kda(hf, chunk_size, sub_size)
    assert err < 1e-4, f"chunk_kda differs from transformers' reference: rel err {err:.2e}"

    def kda(*args, **kwargs):
        return chunk_kda(*args, **{**kwargs, "chunk_size": chunk_size, "sub_size": sub_size})

    hf.chunk_kimi_delta_attention = kda  # looked up at call time by KimiLinearDeltaAttention
    hf.KimiLinearForgetGate.forward = forget_gate_forward
    torch.manual_seed(seed)
    model = hf.KimiLinearForCausalLM(KimiLinearConfig(**CONFIG))
    return model, hf, err


# -- training ------------------------------------------------------------------------------

def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def batch_loss(model, ids: torch.Tensor) -> torch.Tensor:
    ids = ids.long()
    logits = model(input_ids=ids[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, seq: int, max_windows: int | None = None, batch: int = 8) -> float:
    """Mean next-token cross-entropy (nats) over consecutive non-overlapping windows of the stream."""
    was_training = model.training
    model.eval()
    n = (len(stream) - 1) // seq
    if max_windows:
        n = min(n, max_windows)
    total, count = 0.0, 0
    for i in range(0, n, batch):
        idx = torch.arange(i, min(n, i + batch))
        windows = torch.stack([stream[j * seq:j * seq + seq + 1] for j in idx.tolist()])
        total += batch_loss(model, windows).item() * len(idx) * seq
        count += len(idx) * seq
    model.train(was_training)
    return total / count


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=1200, help="optimizer steps (fixes the lr schedule)")
    ap.add_argument("--minutes", type=float, default=60.0,
                    help="wall-time cap: stop early (and say so) if reached before --steps; "
                         "it does not change the schedule or the result of a run that completes")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256, help="tokens per training window")
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--bias-rate", type=float, default=1e-3, help="MoE router bias update per step")
    ap.add_argument("--chunk", type=int, default=16, help="KDA chunk size of the training forward")
    ap.add_argument("--sub", type=int, default=4, help="KDA sub-block size within a chunk")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--out", type=Path, default=ROOT / "models" / "weights" / "builtin")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    t_start = time.time()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train_files, val_files, train, val = load_data(stdlib)
    print(f"data: {stdlib} (Python {sys.version.split()[0]}): {len(train_files)} training files, "
          f"{len(train):,} tokens; validation {[p.name for p in val_files]}, {len(val):,} tokens", flush=True)

    model, hf, kda_err = build_model(args.seed, args.chunk, args.sub)
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters; chunk_kda (chunk "
          f"{args.chunk}, sub-block {args.sub}) vs reference: rel err {kda_err:.1e} (outputs, states, gradients)",
          flush=True)
    model.train()

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and not n.endswith("A_log")]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and not n.endswith("A_log"))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    routers = [m for m in model.modules() if isinstance(m, hf.KimiLinearTopkRouter)]
    loads = {id(r): torch.zeros(r.num_experts) for r in routers}

    def count_load(router, _inp, out):
        loads[id(router)] += torch.bincount(out[2].reshape(-1), minlength=router.num_experts).float()

    hooks = [r.register_forward_hook(count_load) for r in routers]

    gen = torch.Generator().manual_seed(args.seed)
    n_offsets = len(train) - args.seq - 1
    # windows start at the beginning of a line: like a prompt, a context starts at column 0
    prev = train[:n_offsets - 1]
    starts = ((prev == ord("\n")) | (prev == BOS)).nonzero().squeeze(1) + 1
    ema, steps_done, t_train = None, 0, time.time()
    for step in range(args.steps):
        if time.time() - t_start > args.minutes * 60:
            print(f"STOPPED EARLY at step {step}: --minutes {args.minutes} reached", flush=True)
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        offsets = starts[torch.randint(0, len(starts), (args.batch,), generator=gen)]
        ids = torch.stack([train[o:o + args.seq + 1] for o in offsets.tolist()])
        loss = batch_loss(model, ids)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            for r in routers:
                load = loads[id(r)]
                r.e_score_correction_bias += args.bias_rate * torch.sign(load.mean() - load)
                load.zero_()
        steps_done += 1
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % 25 == 0 or step == args.steps - 1:
            el = time.time() - t_train
            print(f"step {step:5d}  loss {loss.item():.4f}  ema {ema:.4f}  gnorm {gnorm:.2f}  "
                  f"lr {opt.param_groups[0]['lr']:.2e}  {el / steps_done:.2f} s/step  {el / 60:.1f} min", flush=True)
        if args.eval_every and step and step % args.eval_every == 0:
            print(f"step {step:5d}  val loss {evaluate(model, val, args.seq, max_windows=64):.4f} (first 64 windows)",
                  flush=True)
    for h in hooks:
        h.remove()
    train_min = (time.time() - t_train) / 60
    print(f"trained {steps_done} steps ({steps_done * args.batch * args.seq:,} tokens) in {train_min:.1f} min",
          flush=True)

    gen_eval = torch.Generator().manual_seed(args.seed + 1)
    offs = starts[torch.randint(0, len(starts), (64,), generator=gen_eval)].tolist()
    with torch.no_grad():
        model.eval()
        tr = sum(batch_loss(model, torch.stack([train[o:o + args.seq + 1] for o in offs[i:i + 8]])).item()
                 for i in range(0, 64, 8)) / 8
    va = evaluate(model, val, args.seq)
    print(f"final train loss (64 random windows) {tr:.4f}  validation loss (all {len(val) // args.seq} windows) "
          f"{va:.4f} nats/byte", flush=True)

    save(model, args.out)
    from models.loader import load_model

    _, cfg = load_model(args.out)
    ref_sd = {k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()}
    model.load_state_dict(ref_sd)  # the fp32 model with the shipped (bf16-rounded) values
    va16 = evaluate(model, val, args.seq)
    print(f"saved {args.out} ({(args.out / 'model.safetensors').stat().st_size / 1e6:.1f} MB, bf16); "
          f"load_model OK ({cfg.layer_kinds}); validation loss of the bf16 weights {va16:.4f}", flush=True)
    print(f"total wall time {(time.time() - t_start) / 60:.1f} min", flush=True)


def save(model, out: Path) -> None:
    """save_pretrained writes the checkpoint names (it undoes transformers' fused-expert and
    renamed layouts); those tensors are then stored in bf16 next to CONFIG's config.json."""
    import tempfile

    from safetensors.torch import load_file, save_file
    from transformers import KimiLinearConfig

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        tensors = {}
        for f in sorted(Path(tmp).glob("*.safetensors")):
            tensors.update(load_file(f))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in sorted(tensors.items())},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)
    KimiLinearConfig(**CONFIG).save_pretrained(out)


if __name__ == "__main__":
    main()
