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
