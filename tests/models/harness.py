"""One harness for the model tests: a tiny HF model saved to disk, loaded by our loader,
run through ForwardBatches over paged KV and state slots, compared with transformers."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from models.batch import ForwardBatch, Memory, Segment
from models.config import ModelConfig
from models.loader import load_model
from tests.utils import rel_err


def save_tiny(hf_model_cls, hf_config, path, seed: int = 0):
    """Random-weight reference model, saved with save_pretrained; returns it (fp32, eval)."""
    torch.manual_seed(seed)
    ref = hf_model_cls(hf_config).float().eval()
    with torch.no_grad():  # random (not default-init) norms, gates and biases
        for name, p in ref.named_parameters():
            if p.dim() == 1 or "A_log" in name:
                p.add_(torch.randn_like(p) * 0.1)
    ref.save_pretrained(path)
    return ref


@dataclass
class Seq:
    slot: int
    pages: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # tokens whose KV/state are final


class PagedRunner:
    """Runs our model with a page allocator (shuffled pages) and one state slot per sequence."""

    def __init__(self, path, page_size: int = 16, num_pages: int = 512, num_slots: int = 32, seed: int = 0, tp=None,
                 device: str = "cpu", dtype: torch.dtype = torch.float32):
        self.model, self.cfg = load_model(path, device, dtype=dtype, tp=tp)
        self.device = device
        cfg: ModelConfig = self.cfg
        self.memory = Memory(
            kv=[{n: torch.zeros(num_pages, page_size, *s, device=device, dtype=dtype) for n, s in layer.items()}
                for layer in cfg.kv_shapes],
            state=[{n: torch.full((num_slots, *s), float("nan"), dtype=dt, device=device)
                    for n, (s, dt) in layer.items()} for layer in cfg.state_shapes],
            page_size=page_size,
        )
        self.free_pages = list(range(num_pages))
        random.Random(seed).shuffle(self.free_pages)
        self.free_slots = list(range(num_slots))

    def new_seq(self) -> Seq:
        return Seq(slot=self.free_slots.pop(0))

    def checkpoint_slot(self) -> int:
        return self.free_slots.pop(0)

    def restore(self, seq: Seq, checkpoint_slot: int, tokens: list[int]):
        """Resume `seq` from a checkpoint slot holding the state after `tokens` (KV already paged)."""
        for layer in self.memory.state:
            for buf in layer.values():
                buf[seq.slot] = buf[checkpoint_slot]
        seq.tokens = list(tokens)

    def segment(self, seq: Seq, new: list[int], checkpoints=()) -> Segment:
        """The segment extending `seq` by `new`, with pages allocated for it."""
        need = -(-(len(seq.tokens) + len(new)) // self.memory.page_size)
        while len(seq.pages) < need:
            seq.pages.append(self.free_pages.pop())
        return Segment(new, len(seq.tokens), seq.slot, list(seq.pages), checkpoints)

    def step(self, work: list[tuple[Seq, list[int]]], checkpoints=None, all_logits=False) -> list[torch.Tensor]:
        """One forward: each (seq, new tokens) extends its sequence; returns logits per segment."""
        segs = [self.segment(seq, new, (checkpoints or {}).get(i, ())) for i, (seq, new) in enumerate(work)]
        batch = ForwardBatch.build(segs, self.memory, self.device, all_logits=all_logits)
        logits = self.model(batch)
        for seq, new in work:
            seq.tokens += list(new)
        if not all_logits:
            return list(logits.unbind(0))
        return list(logits.split([len(new) for _, new in work]))


def hf_logits(ref, ids: list[int]) -> torch.Tensor:
    """Reference logits [len(ids), vocab] of one sequence, no cache."""
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float()


# ---- the checks every architecture runs (each returns nothing, asserts inside) ----

TOL = 1e-4


def _close(ours: torch.Tensor, ref: torch.Tensor, what: str):
    err = rel_err(ours, ref)
    assert err < TOL, f"{what}: rel err {err:.2e} >= {TOL}"


def prompt(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def check_one_shot(ref, path, vocab):
    run = PagedRunner(path)
    ids = prompt(vocab, 150, 1)
    (ours,) = run.step([(run.new_seq(), ids)], all_logits=True)
    _close(ours, hf_logits(ref, ids), "one-shot prefill")


def check_chunked(ref, path, vocab, cuts=(64, 128)):
    run = PagedRunner(path)
    ids = prompt(vocab, 150, 2)
    seq, bounds, out = run.new_seq(), [0, *cuts, len(ids)], []
    for a, b in zip(bounds, bounds[1:]):
        out += run.step([(seq, ids[a:b])], all_logits=True)
    _close(torch.cat(out), hf_logits(ref, ids), f"chunked prefill at {cuts}")


def check_decode(ref, path, vocab, steps=8):
    run = PagedRunner(path)
    ids = prompt(vocab, 70, 3)
    seq = run.new_seq()
    run.step([(seq, ids[:-steps])])
    out = [run.step([(seq, [t])])[0] for t in ids[-steps:]]
    _close(torch.stack(out), hf_logits(ref, ids)[-steps:], "prefill + decode steps")


def check_mixed(ref, path, vocab):
    """Three requests of different lengths in one batch, the last one decoding."""
    run = PagedRunner(path)
    a, b, c = prompt(vocab, 90, 4), prompt(vocab, 33, 5), prompt(vocab, 41, 6)
    sa, sb, sc = run.new_seq(), run.new_seq(), run.new_seq()
    run.step([(sa, a[:64]), (sc, c[:-1])])
    la, lb, lc = run.step([(sa, a[64:]), (sb, b), (sc, c[-1:])], all_logits=True)
    _close(la, hf_logits(ref, a)[64:], "mixed: continued prefill")
    _close(lb, hf_logits(ref, b), "mixed: fresh prefill")
    _close(lc, hf_logits(ref, c)[-1:], "mixed: decode row")


def check_greedy(ref, path, vocab, new=16):
    run = PagedRunner(path)
    ids = prompt(vocab, 40, 7)
    with torch.no_grad():
        want = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                            max_new_tokens=new, do_sample=False, min_new_tokens=new)[0, len(ids):]
    seq, got = run.new_seq(), []
    logits = run.step([(seq, ids)])[0]
    for _ in range(new):
        got.append(int(logits.argmax()))
        logits = run.step([(seq, [got[-1]])])[0]
    assert got == want.tolist()


def check_resume(ref, path, vocab):
    """Logits after resuming from a checkpoint taken mid-prefill == computing from scratch."""
    run = PagedRunner(path)
    ids = prompt(vocab, 150, 8)
    seq, ck = run.new_seq(), run.checkpoint_slot()
    run.step([(seq, ids[:140])], checkpoints={0: [(128, ck)]})
    other = run.new_seq()
    other.pages = seq.pages[: 128 // run.memory.page_size]  # share the KV of the first 128 tokens
    run.restore(other, ck, ids[:128])
    (ours,) = run.step([(other, ids[128:])], all_logits=True)
    _close(ours, hf_logits(ref, ids)[128:], "resume from checkpoint")


def check_fused_decode(ref, path, vocab, fused: tuple[str, ...]):
    """A decode-only batch through the layers' one-call compiled bodies (models/batch.py
    FUSED_DECODE; `fused`: the kernels/native.py calls the model makes then) gives the bits of the
    same kernels called one by one: logits, KV pages and states after each of several steps, in
    fp32 and bf16."""
    import pytest

    import models.batch
    from kernels import native

    if native.extension() is None:
        pytest.skip("CPU kernels not built here")
    calls = dict.fromkeys(fused, 0)

    def counted(name, fn):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            calls[name] += out is not None
            return out
        return call

    saved = {name: getattr(native, name) for name in fused}
    for name, fn in saved.items():
        setattr(native, name, counted(name, fn))
    try:
        for dtype in (torch.float32, torch.bfloat16):
            runs = {on: PagedRunner(path, dtype=dtype) for on in (True, False)}
            prompts = [prompt(vocab, n, 9 + i) for i, n in enumerate((37, 16, 70))]
            seqs = {on: [run.new_seq() for _ in prompts] for on, run in runs.items()}
            for on, run in runs.items():
                run.step(list(zip(seqs[on], prompts)))
            g = torch.Generator().manual_seed(10)
            for _ in range(4):
                new = [[int(t)] for t in torch.randint(0, vocab, (len(prompts),), generator=g)]
                out = {}
                for on, run in runs.items():
                    models.batch.FUSED_DECODE = on
                    try:
                        out[on] = run.step(list(zip(seqs[on], new)))
                    finally:
                        models.batch.FUSED_DECODE = True
                for a, b in zip(out[True], out[False]):
                    torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{dtype}: logits differ")
                pools = [[t for layer in run.memory.kv + run.memory.state for t in layer.values()]
                         for run in runs.values()]
                for a, b in zip(*pools):  # unused state slots hold NaN in both
                    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True,
                                               msg=f"{dtype}: KV pages or states differ")
    finally:
        for name, fn in saved.items():
            setattr(native, name, fn)
    assert all(calls.values()), f"the fused decode calls did not run: {calls}"


CHECKS = [check_one_shot, check_chunked, check_decode, check_mixed, check_greedy, check_resume]
