import pytest
import torch

from tests.models import harness
from tests.utils import import_torch_reference

hf_mod = import_torch_reference("transformers.models.nemotron_h.modeling_nemotron_h")
from transformers import NemotronHConfig  # noqa: E402

# The second layout draws dt_bias just above time_step_min, so the dt clamp changes logits.
LAYOUTS = {
    "ME*M-": dict(hybrid_override_pattern="ME*M-", num_key_value_heads=2, num_experts_per_tok=2, n_group=1,
                  topk_group=1, n_groups=2, chunk_size=32),
    "*MEM-latent": dict(hybrid_override_pattern="*MEM-", num_key_value_heads=1, num_experts_per_tok=3, n_group=2,
                        topk_group=1, n_groups=1, chunk_size=128, moe_latent_size=24, use_bias=True,
                        use_conv_bias=False, mlp_bias=True, time_step_min=0.2, time_step_max=0.25),
}


def tiny(layout):
    """initializer_range 0.1 (not 0.02): the SSM scan, not only its D skip, must move the logits."""
    return NemotronHConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_attention_heads=4, head_dim=16,
        mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, conv_kernel=4, n_routed_experts=6,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, initializer_range=0.1, **LAYOUTS[layout],
    )


@pytest.fixture(scope="module", params=list(LAYOUTS))
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"nemotron-h-{request.param}")
    ref = harness.save_tiny(hf_mod.NemotronHForCausalLM, tiny(request.param), path)
    return ref, path, ref.config.vocab_size


@pytest.mark.parametrize("check", harness.CHECKS, ids=lambda c: c.__name__)
def test_nemotron_h_matches_transformers(model, check):
    """Our NemotronH forward over paged KV/state slots equals transformers' (fp32, rel err < 1e-4)."""
    check(*model)


def test_nemotron_h_fused_decode_gives_the_bits_of_its_kernels_one_by_one(model):
    """Decode-only batches through the one-call Mamba2 and attention bodies equal the
    kernel-by-kernel path bit for bit (logits, KV pages, states), fp32 and bf16."""
    harness.check_fused_decode(*model, fused=("mamba_decode", "attention_decode"))


def test_nemotron_h_norm_inside_the_ssd_kernel_gives_the_bits_of_the_norm_pass(model, monkeypatch):
    """Prefill and mixed rounds (continued and fresh prefills beside a decode row) with the gated
    norm applied inside the SSD prefill kernel give the logits and states of the separate norm
    pass, bit for bit (fp32); the kernel did take the norm."""
    from kernels import native
    from models.nemotron_h import Mamba2Mixer

    if native.extension() is None:
        pytest.skip("CPU kernels not built here")
    ref, path, vocab = model
    gated = []
    chunk_ssd = native.chunk_ssd
    monkeypatch.setattr(native, "chunk_ssd", lambda *a, gate=None: gated.append(gate is not None) or chunk_ssd(
        *a, gate=gate))
    a, b, c = (harness.prompt(vocab, n, 20 + i) for i, n in enumerate((90, 33, 41)))
    out = {}
    for fuse in (True, False):
        monkeypatch.setattr(Mamba2Mixer, "fuse_norm", fuse)
        run = harness.PagedRunner(path)
        sa, sb, sc = run.new_seq(), run.new_seq(), run.new_seq()
        first = run.step([(sa, a[:64]), (sc, c[:-1])], all_logits=True)
        mixed = run.step([(sa, a[64:]), (sb, b), (sc, c[-1:])], all_logits=True)
        out[fuse] = (first + mixed, [t for layer in run.memory.state for t in layer.values()])
    for got, want in zip(out[True][0], out[False][0]):
        assert torch.equal(got, want)
    for got, want in zip(out[True][1], out[False][1]):  # unused slots hold NaN in both
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert any(gated) and not all(gated)
