import pytest

from tests.models import harness
from tests.utils import import_torch_reference

hf_mod = import_torch_reference("transformers.models.qwen3_next.modeling_qwen3_next")
from transformers import Qwen3NextConfig  # noqa: E402

LAYOUTS = {
    "3:1-gqa2": dict(layer_types=["linear_attention"] * 3 + ["full_attention"], mlp_only_layers=[0],
                     num_key_value_heads=2, num_experts_per_tok=2, linear_num_value_heads=4, linear_value_head_dim=8,
                     partial_rotary_factor=0.25),
    "1:1-mqa": dict(layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
                    decoder_sparse_step=2, num_key_value_heads=1, num_experts_per_tok=3, linear_num_value_heads=2,
                    linear_value_head_dim=16, partial_rotary_factor=0.5),
}


def tiny(layout, **overrides):
    return Qwen3NextConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, head_dim=16, num_experts=6,
        linear_num_key_heads=2, linear_key_head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        **{**LAYOUTS[layout], **overrides},
    )


@pytest.fixture(scope="module", params=list(LAYOUTS))
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"qwen3next-{request.param}")
    ref = harness.save_tiny(hf_mod.Qwen3NextForCausalLM, tiny(request.param), path)
    return ref, path, ref.config.vocab_size


@pytest.mark.parametrize("check", harness.CHECKS, ids=lambda c: c.__name__)
def test_qwen3_next_matches_transformers(model, check):
    """Our Qwen3-Next forward over paged KV/state slots equals transformers' (fp32, rel err < 1e-4)."""
    check(*model)


def test_qwen3_next_fused_decode_gives_the_bits_of_its_kernels_one_by_one(model):
    """Decode-only batches through the one-call layer bodies equal the kernel-by-kernel path bit
    for bit (logits, KV pages, states), fp32 and bf16."""
    harness.check_fused_decode(*model, fused=("delta_decode", "attention_decode"))


def test_qwen3_next_tied_embeddings(tmp_path):
    """With tie_word_embeddings the loaded lm_head is the embedding, so logits match transformers."""
    ref = harness.save_tiny(hf_mod.Qwen3NextForCausalLM, tiny("1:1-mqa", tie_word_embeddings=True), tmp_path)
    harness.check_one_shot(ref, tmp_path, ref.config.vocab_size)
