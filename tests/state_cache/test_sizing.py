"""Pool sizing from layer specs and a byte budget, and the figures quoted in docs/state_cache.md.

`python -m tests.state_cache.test_sizing` prints the docs' figures block.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from state_cache import kv_bytes_per_token, make_pools, plan_memory, state_bytes_per_slot

# moonshotai/Kimi-Linear-48B-A3B-Instruct config.json (layer indices there are 1-based)
KIMI_48B = {
    "hidden_size": 2304, "num_hidden_layers": 27, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "num_heads": 32, "head_dim": 128,
        "short_conv_kernel_size": 4,
    },
}
# the built-in tiny Kimi-Linear of models/ (assumed: MLA at 0-based layers 3 and 7)
BUILTIN = {
    "hidden_size": 256, "num_hidden_layers": 8, "kv_lora_rank": 128, "qk_rope_head_dim": 32,
    "linear_attn_config": {"full_attn_layers": [4, 8], "num_heads": 4, "head_dim": 64, "short_conv_kernel_size": 4},
}
DOC = Path(__file__).resolve().parents[2] / "docs" / "state_cache.md"
GIB = 1 << 30


def kimi_linear_specs(cfg: dict, dtype: torch.dtype) -> tuple[list, list]:
    """Per-layer pool specs of a Kimi-Linear config: MLA latent + rope key; KDA state + q/k/v conv tails."""
    lin = cfg["linear_attn_config"]
    attn = {i - 1 for i in lin["full_attn_layers"]}
    n_attn = len(attn)
    d = lin["num_heads"] * lin["head_dim"]
    kda = {
        "recurrent": ((lin["num_heads"], lin["head_dim"], lin["head_dim"]), torch.float32),
        **{f"conv_{x}": ((d, lin["short_conv_kernel_size"] - 1), dtype) for x in "qkv"},
    }
    kv = [{"kv": (1, cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])}] * n_attn
    return kv, [kda] * (cfg["num_hidden_layers"] - n_attn)


def figures() -> str:
    """The markdown figures block of the docs, computed from the configs above."""
    rows = [
        "| model | attn / linear layers | KV bytes per token | bytes per checkpoint | 1 checkpoint = KV tokens |",
        "|---|---|---|---|---|",
    ]
    for name, cfg, dtype in (("Kimi-Linear-48B-A3B (bf16)", KIMI_48B, torch.bfloat16),
                             ("built-in tiny Kimi-Linear (bf16)", BUILTIN, torch.bfloat16),
                             ("built-in tiny Kimi-Linear (fp32)", BUILTIN, torch.float32)):
        kv, st = kimi_linear_specs(cfg, dtype)
        tok, slot = kv_bytes_per_token(kv, dtype), state_bytes_per_slot(st)
        rows.append(f"| {name} | {len(kv)} / {len(st)} | {tok:,} | {slot:,} | {slot / tok:,.0f} |")
    kv, st = kimi_linear_specs(KIMI_48B, torch.bfloat16)
    plan = plan_memory(kv, st, budget_bytes=30 * GIB, page_size=16, max_running=64, checkpoint_share=0.2)
    return "\n".join(rows) + "\n\n```\n" + plan.report() + "\n```"


def test_kimi_48b_figures():
    """Kimi-Linear-48B: 7 MLA layers x 576 bf16 = 8064 B per token; 20 KDA layers x (2 MiB fp32 + 72 KiB conv)."""
    kv, st = kimi_linear_specs(KIMI_48B, torch.bfloat16)
    assert kv_bytes_per_token(kv, torch.bfloat16) == 7 * (512 + 64) * 2 == 8064
    assert state_bytes_per_slot(st) == 20 * (32 * 128 * 128 * 4 + 3 * 4096 * 3 * 2) == 43_417_600


def test_docs_quote_the_computed_figures():
    """docs/state_cache.md holds exactly the figures block computed here (regenerate with __main__)."""
    assert figures() in DOC.read_text()


def test_plan_splits_the_budget():
    """Active slots come off the top; checkpoints get their share of the rest, pages the remainder; all fit."""
    kv, st = kimi_linear_specs(BUILTIN, torch.float32)
    tok, slot = kv_bytes_per_token(kv, torch.bfloat16), state_bytes_per_slot(st)
    budget = 64 << 20
    plan = plan_memory(kv, st, budget_bytes=budget, page_size=16, max_running=8, checkpoint_share=0.25)
    rest = budget - 8 * slot
    assert plan.num_active == 8 and plan.num_checkpoints == int(rest * 0.25) // slot
    assert plan.num_pages == (rest - plan.num_checkpoints * slot) // (16 * tok)
    used = plan.kv_bytes + plan.active_bytes + plan.checkpoint_bytes
    assert budget - 16 * tok - slot < used <= budget
    assert f"{plan.num_checkpoints} x" in plan.report() and f"{plan.num_pages} x 16 tokens" in plan.report()
    pools = make_pools(plan, kv, st, torch.bfloat16, None)
    assert (pools[0].num_pages, pools[1].num_checkpoints, pools[1].num_active) == (
        plan.num_pages, plan.num_checkpoints, 8)
    no_ckpt = plan_memory(kv, st, budget_bytes=budget, page_size=16, max_running=8, checkpoint_share=0.0)
    assert no_ckpt.num_checkpoints == 0 and no_ckpt.num_pages > plan.num_pages


@pytest.mark.parametrize("kwargs,field", [
    ({"budget_bytes": 1000}, "budget_bytes"), ({"checkpoint_share": 1.5}, "checkpoint_share"),
    ({"page_size": 0}, "page_size"), ({"max_running": 0}, "max_running"),
])
def test_plan_rejects_bad_arguments(kwargs, field):
    """A budget below the active slots or an out-of-range argument raises ValueError naming it."""
    kv, st = kimi_linear_specs(BUILTIN, torch.float32)
    args = {"budget_bytes": 1 << 30, "page_size": 16, "max_running": 4, **kwargs}
    with pytest.raises(ValueError, match=field):
        plan_memory(kv, st, **args)
    with pytest.raises(ValueError, match="kv_layers"):
        plan_memory([], st, budget_bytes=1 << 30, page_size=16, max_running=4)


if __name__ == "__main__":
    print(figures())


def test_unified_plan_shares_one_pool_of_pages():
    """The one budget: active slots and staging rows (at most max_running) off the top, every
    other byte in pages that KV and checkpoints share; the host tier sized in the same pages."""
    kv, st = kimi_linear_specs(BUILTIN, torch.float32)
    tok, slot = kv_bytes_per_token(kv, torch.bfloat16), state_bytes_per_slot(st)
    budget = 64 << 20
    plan = plan_memory(kv, st, budget_bytes=budget, page_size=16, max_running=8, staging_rows=4,
                       host_bytes=1 << 30)
    assert plan.unified and plan.num_checkpoints == 4
    assert plan.num_pages == (budget - 12 * slot) // (16 * tok)
    assert plan.host_pages == (1 << 30) // (16 * tok) and plan.pages_per_checkpoint == -(-slot // (16 * tok))
    assert "one budget" in plan.report() and "host tier" in plan.report()
    assert plan_memory(kv, st, budget_bytes=budget, page_size=16, max_running=2, staging_rows=8).num_checkpoints == 2
    kv_pool, state_pool = make_pools(plan, kv, st, torch.bfloat16, None)
    assert state_pool.arena is kv_pool and state_pool.pages_per_checkpoint == plan.pages_per_checkpoint
