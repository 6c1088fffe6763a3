import pytest
import torch

from kernels import native
from tests.models import harness
from tests.utils import import_torch_reference, rel_err

hf_mod = import_torch_reference("transformers.models.kimi_linear.modeling_kimi_linear")
from transformers import KimiLinearConfig  # noqa: E402

LAYOUTS = {
    "3:1": dict(layer_types=["linear_attention"] * 3 + ["full_attention"], mlp_layer_types=["dense"] + ["sparse"] * 3,
                top_k=2, q_lora_rank=None),
    "1:1-qlora": dict(layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
                      mlp_layer_types=["sparse"] * 4, top_k=3, q_lora_rank=24),
}


def tiny(layout):
    spec = dict(LAYOUTS[layout])
    return KimiLinearConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16,
        qk_nope_head_dim=16, num_local_experts=6, num_experts_per_tok=spec.pop("top_k"), n_group=2, topk_group=1,
        linear_head_dim=16, linear_num_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, **spec,
    )


@pytest.fixture(scope="module", params=list(LAYOUTS))
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"kimi-{request.param}")
    ref = harness.save_tiny(hf_mod.KimiLinearForCausalLM, tiny(request.param), path)
    return ref, path, ref.config.vocab_size


@pytest.mark.parametrize("check", harness.CHECKS, ids=lambda c: c.__name__)
def test_kimi_linear_matches_transformers(model, check):
    """Our Kimi Linear forward over paged KV/state slots equals transformers' (fp32, rel err < 1e-4)."""
    check(*model)


def test_kimi_linear_fused_decode_gives_the_bits_of_its_kernels_one_by_one(model):
    """Decode-only batches through the one-call layer bodies equal the kernel-by-kernel path bit
    for bit (logits, KV pages, states), fp32 and bf16."""
    fused = ("delta_decode", "mla_decode") if native._bf16_gemm() else ("delta_decode",)  # MLA's: bf16 kernels
    harness.check_fused_decode(*model, fused=fused)


def test_mla_prefill_attends_in_expanded_form_where_it_saves_work(model, monkeypatch):
    """Prefill segments of at least r (nope + v) / (2r - nope - v) queries (32 here) attend with
    per-head keys and values up-projected from the cached latents, the rest (short chunks,
    decode rows) in the latent space; both forms give the same logits (fp32)."""
    from models.kimi_linear import MLAttention

    _, path, vocab = model
    picked = []
    rule = MLAttention.expanded_segments
    monkeypatch.setattr(MLAttention, "expanded_segments",
                        lambda self, b: picked.append(None if (s := rule(self, b)) is None else s.tolist()) or s)
    a, b, c = harness.prompt(vocab, 90, 4), harness.prompt(vocab, 31, 5), harness.prompt(vocab, 41, 6)

    def logits():
        run = harness.PagedRunner(path)
        sa, sb, sc = run.new_seq(), run.new_seq(), run.new_seq()
        run.step([(sa, a[:50]), (sc, c[:-1])])
        return torch.cat(run.step([(sa, a[50:]), (sb, b), (sc, c[-1:])], all_logits=True))

    expanded = logits()
    layers = len(picked) // 2
    assert picked[:layers] == [[True, True]] * layers  # 50 and 40 queries
    assert picked[layers:] == [[True, False, False]] * layers  # 40, 31 queries, a decode row
    monkeypatch.setattr(MLAttention, "expanded_segments", lambda self, b: None)
    assert rel_err(expanded, logits()) < 1e-5
