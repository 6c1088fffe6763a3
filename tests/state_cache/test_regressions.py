"""The failure cases users report against hybrid prefix caches, as named regression tests."""
import random

import pytest
import torch

from state_cache import KVPool, StatePool, StateRadixCache
from tests.state_cache.harness import ToyEngine, make_cache, reference_state

CHUNK = 64


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def _assert_state(got: dict[str, torch.Tensor], tokens) -> None:
    want = reference_state(tokens)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert torch.equal(got[name], want[name]), f"{name} differs from a run from scratch"


@pytest.mark.parametrize("page_size", [1, 16, 64, 128])
@pytest.mark.parametrize("mode", ["chunked", "interval"])
def test_short_prompt_hits_every_grid_point(page_size, mode):
    """A prompt shorter than a 512-token block hits at every multiple of G it holds."""
    cache = make_cache(page_size, CHUNK)
    g = cache.granularity
    engine = ToyEngine(cache, chunk=g if mode == "chunked" else None, interval=g if mode == "interval" else None)
    prompt = _tokens(300, seed=1)
    engine.run(prompt, [7])
    for m in range(g, 300, g):
        other = prompt[:m] + _tokens(300 - m, seed=100 + m)
        hit = cache.match_prefix(other)
        assert hit.state_len == m and hit.checkpoint.pos == m
        run = engine.run(other, [5, 6])
        assert run.match.state_len == m
        _assert_state(run.state, other + [5])
    cache.check_integrity()


@pytest.mark.parametrize("prompt_len", [300, 256, 65, 64])
@pytest.mark.parametrize("page_size", [16, 64])
def test_identical_resend_hits_last_grid_point_before_final_token(prompt_len, page_size):
    """Resending a prompt resumes at the last multiple of G <= len - 1, and ends in the same state."""
    cache = make_cache(page_size, CHUNK)
    engine = ToyEngine(cache)
    prompt = _tokens(prompt_len, seed=2)
    first = engine.run(prompt, [3, 4, 5])
    second = engine.run(prompt, [3, 4, 5])
    want = (prompt_len - 1) // CHUNK * CHUNK
    assert first.match.state_len == 0
    assert second.match.state_len == want
    assert second.computed == prompt_len - want + 2
    _assert_state(second.state, prompt + [3, 4])
    cache.check_integrity()


@pytest.mark.parametrize("prompt_len,output_len", [(150, 120), (192, 5), (100, 300)])
def test_next_turn_hits_last_grid_point_of_previous_output(prompt_len, output_len):
    """A conversation's next turn resumes at the last G-position of prompt + output of the previous turn."""
    cache = make_cache(16, CHUNK)
    engine = ToyEngine(cache, chunk=128)
    prompt, output = _tokens(prompt_len, seed=3), _tokens(output_len, seed=4)
    engine.run(prompt, output)
    turn2 = prompt + output + _tokens(20, seed=5)
    run = engine.run(turn2, [1, 2])
    assert run.match.state_len == (prompt_len + output_len - 1) // CHUNK * CHUNK
    _assert_state(run.state, turn2 + [1])
    cache.check_integrity()


def test_restored_checkpoint_is_bit_identical_and_keeps_dtype():
    """A checkpoint restored through the cache equals the saved state bit for bit, fp32 stays fp32."""
    layers = [
        {"recurrent": ((2, 4, 4), torch.float32), "conv": ((8, 3), torch.bfloat16)},
        {"recurrent": ((2, 4, 4), torch.float32)},
    ]
    kv = KVPool(8, 4, [{"kv": (1, 6)}], torch.bfloat16, "cpu")
    st = StatePool(2, 2, layers, "cpu")
    cache = StateRadixCache(kv, st, {"kda": 4})
    src = st.alloc_active()
    g = torch.Generator().manual_seed(0)
    for layer in st.buffers:
        for buf in layer.values():
            buf[src] = (torch.randn(buf.shape[1:], generator=g) * 1e-3 + 1.0).to(buf.dtype)
    saved = [{n: b[src].clone() for n, b in layer.items()} for layer in st.buffers]
    ck = cache.alloc_checkpoint()
    st.save(src, ck)
    tokens = list(range(9))
    cache.insert(tokens, cache.alloc_pages(2), {8: ck})
    hit = cache.match_prefix(tokens)
    dst = st.alloc_active()
    cache.restore(hit.checkpoint, dst)
    for layer, want in zip(st.buffers, saved):
        for name, buf in layer.items():
            assert buf[dst].dtype == want[name].dtype == layers[st.buffers.index(layer)][name][1]
            assert torch.equal(buf[dst], want[name])
    assert st.buffers[0]["recurrent"].dtype == torch.float32
    with pytest.raises(ValueError, match="sealed"):
        st.save(dst, ck)
