"""ForwardBatch sentinels and the constants the models share with the kernels."""
import torch

import kernels.gdn
import kernels.kda
from kernels.attention import PAD_PAGE, paged_attention
from models.batch import ForwardBatch, Memory, Segment
from models.config import ModelConfig
from tests.models.test_kimi_linear import tiny as kimi_tiny
from tests.models.test_qwen3_next import tiny as qwen_tiny


def test_page_table_pads_with_the_named_sentinel():
    """Rows shorter than the widest are padded with PAD_PAGE (-1, never a page id), and the
    paged attention of a padded row equals that of the row alone."""
    assert PAD_PAGE == -1
    mem = Memory([{"kv": torch.randn(8, 4, 1, 8)}], [], page_size=4)
    segs = [Segment([1, 2, 3], 0, 0, [5]), Segment([4] * 9, 0, 1, [0, 3, 7])]
    fb = ForwardBatch.build(segs, mem)
    assert fb.page_table.tolist() == [[5, PAD_PAGE, PAD_PAGE], [0, 3, 7]]
    cache = mem.kv[0]["kv"]
    q = torch.randn(fb.num_tokens, 2, 8)
    both = paged_attention(q, cache, None, fb.page_table, fb.cu_seqlens, fb.seq_lens, v_dim=8)
    alone = ForwardBatch.build(segs[:1], mem)
    first = paged_attention(q[:3], cache, None, alone.page_table, alone.cu_seqlens, alone.seq_lens, v_dim=8)
    torch.testing.assert_close(both[:3], first, rtol=0, atol=0)


def test_models_take_their_kernel_chunk_from_the_kernels():
    """The chunk the cache grid is built on is the kernels' own constant, not a copy."""
    kimi = ModelConfig.from_hf(kimi_tiny("3:1"))
    qwen = ModelConfig.from_hf(qwen_tiny("3:1-gqa2"))
    assert kimi.kernel_chunks == {"kda": kernels.kda.CHUNK} and qwen.kernel_chunks == {"gdn": kernels.gdn.CHUNK}
    assert kernels.gdn.CHUNK is kernels.kda.CHUNK


def test_build_places_every_token_by_hand():
    """A mixed batch of random prefill segments (with checkpoints) and decode rows: each token's
    position, KV slot (its page, by the segment's own page list, times page_size plus its offset,
    as kernels/attention slot_mapping places it) and every offset table, against a per-token
    walk of the segments."""
    import random

    rng, ps = random.Random(5), 4
    segs = []
    for i in range(9):
        prefix, n = (rng.randrange(0, 40), rng.randrange(2, 30)) if i < 5 else (rng.randrange(1, 40), 1)
        pages = rng.sample(range(100), (prefix + n + ps - 1) // ps + rng.randrange(2))
        ck = [(prefix + n, 50 + i)] if i < 5 and rng.random() < 0.6 else []
        segs.append(Segment([rng.randrange(1000) for _ in range(n)], prefix, i, pages, ck))
    fb = ForwardBatch.build(segs, Memory([], [], page_size=ps), logits_for=[6, 0, 3])
    ids, pos, slots, cu, ck_at, ck_slots = [], [], [], [0], [], []
    for s in segs:
        for j, tok in enumerate(s.input_ids):
            p = s.prefix_len + j
            ids.append(tok)
            pos.append(p)
            slots.append(s.pages[p // ps] * ps + p % ps)
        for p, slot in s.checkpoints:
            ck_at.append(cu[-1] + p - s.prefix_len)
            ck_slots.append(slot)
        cu.append(cu[-1] + len(s.input_ids))
    assert fb.input_ids.tolist() == ids and fb.positions.tolist() == pos and fb.kv_slots.tolist() == slots
    assert fb.cu_seqlens.tolist() == cu and fb.seq_lens.tolist() == [s.prefix_len + len(s.input_ids) for s in segs]
    assert fb.prefix_lens.tolist() == [s.prefix_len for s in segs] and fb.state_slots.tolist() == list(range(9))
    assert ck_at and fb.checkpoint_at.tolist() == ck_at and fb.checkpoint_slots.tolist() == ck_slots
    assert fb.logits_at.tolist() == [cu[7] - 1, cu[1] - 1, cu[4] - 1] and fb.num_decodes == 4
    assert all(t.dtype == torch.long for t in (fb.input_ids, fb.positions, fb.kv_slots, fb.logits_at))
    assert ForwardBatch.build(segs, Memory([], [], page_size=ps), logits_for=[]).logits_at.tolist() == []
    with_all = ForwardBatch.build(segs, Memory([], [], page_size=ps), all_logits=True)
    assert with_all.logits_at.tolist() == list(range(cu[-1]))
