import subprocess
import sys

SCRIPT = """
import kernels, models, torch
assert kernels.__file__.startswith(ROOT), kernels.__file__
from transformers.utils.import_utils import is_kernels_available
assert not is_kernels_available(), "transformers mistakes our `kernels` package for the HF kernels hub"
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1)
out = LlamaForCausalLM(cfg).eval()(torch.tensor([[1, 2, 3]])).logits
assert out.shape == (1, 3, 32) and torch.isfinite(out).all()
print("ok")
"""


def test_transformers_ignores_our_kernels_package():
    """With our top-level `kernels` importable, transformers does not believe the HF kernels hub
    is installed, and a transformers model still runs a forward."""
    root = __file__.rsplit("/tests/", 1)[0]
    res = subprocess.run([sys.executable, "-c", f"ROOT = {root!r}\n" + SCRIPT], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]
