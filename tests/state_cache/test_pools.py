"""KVPool and StatePool: accounting, errors, tensors and the no-tensor mode."""
import pytest
import torch

from state_cache import IntegrityError, KVPool, StatePool, kv_bytes_per_token, state_bytes_per_slot

MLA = [{"kv": (1, 160)}, {"kv": (1, 160)}]
KDA = [{"recurrent": ((4, 64, 64), torch.float32), "conv": ((768, 3), torch.bfloat16)}]


def test_kv_pool_buffers_follow_layer_specs():
    """One [num_pages, page_size, *shape] tensor per attention layer per name, in the pool dtype."""
    pool = KVPool(5, 4, [{"k": (2, 8), "v": (2, 8)}, {"kv": (1, 12)}], torch.bfloat16, "cpu")
    assert [sorted(b) for b in pool.buffers] == [["k", "v"], ["kv"]]
    assert pool.buffers[0]["k"].shape == (5, 4, 2, 8) and pool.buffers[1]["kv"].shape == (5, 4, 1, 12)
    assert all(t.dtype == torch.bfloat16 for b in pool.buffers for t in b.values())
    assert pool.bytes_per_token == (16 + 16 + 12) * 2 and pool.bytes_per_page == pool.bytes_per_token * 4


def test_kv_pool_alloc_free_refcounts():
    """Alloc hands out distinct pages with count 1, None when short (taking nothing); free returns them at 0."""
    pool = KVPool(4, 2)
    a = pool.alloc(3)
    assert sorted(a) == [0, 1, 2] and pool.num_free == 1
    assert pool.alloc(2) is None and pool.num_free == 1
    pool.ref([a[0]])
    assert pool.refcount(a[0]) == 2
    assert pool.free(a) == 2 and pool.num_free == 3
    assert pool.free([a[0]]) == 1 and pool.num_free == 4
    pool.check_integrity()


def test_kv_pool_errors_name_the_argument_and_change_nothing():
    """Double free, refs to free pages and bad ids raise ValueError naming the argument, before any change."""
    pool = KVPool(2, 1)
    with pytest.raises(ValueError, match="pages: page 0 is already free"):
        pool.free([0])
    with pytest.raises(ValueError, match="pages: page 1 is free"):
        pool.ref([1])
    (page,) = pool.alloc(1)
    with pytest.raises(ValueError, match="pages: page id 7"):
        pool.free([page, 7])
    with pytest.raises(ValueError, match="already free"):
        pool.free([page, page])
    with pytest.raises(ValueError, match="pages: page id -1"):
        pool.ref([page, -1])
    assert pool.refcount(page) == 1 and pool.num_free == 1
    pool.check_integrity()
    with pytest.raises(ValueError, match="num_pages"):
        KVPool(-1, 4)
    with pytest.raises(ValueError, match="page_size"):
        KVPool(4, 0)


def test_kv_pool_integrity_detects_corruption():
    """check_integrity fails when the free list and the counts disagree."""
    pool = KVPool(4, 1)
    pool.alloc(2)
    pool.check_integrity()
    pool._free.append(0)
    with pytest.raises(IntegrityError):
        pool.check_integrity()


def test_no_tensor_pools_count_and_account_bytes():
    """device=None allocates nothing but counts and sizes like the tensor pools."""
    kv = KVPool(1_000_000, 16, MLA, torch.bfloat16, None)
    st = StatePool(8, 100, KDA, None)
    assert kv.buffers == [] and st.buffers == []
    assert kv.bytes_per_token == kv_bytes_per_token(MLA, torch.bfloat16) == 2 * 160 * 2
    assert st.bytes_per_slot == state_bytes_per_slot(KDA) == 4 * 64 * 64 * 4 + 768 * 3 * 2
    assert len(kv.alloc(999_999)) == 999_999
    slot = st.alloc_active()
    ck = st.alloc_checkpoint()
    st.save(slot, ck)
    st.restore(ck, slot)
    kv.check_integrity()
    st.check_integrity()


def test_state_pool_regions_and_dtypes():
    """Active ids come first, checkpoint ids after; one tensor per layer per name in its own dtype."""
    st = StatePool(2, 3, KDA, "cpu")
    assert st.buffers[0]["recurrent"].shape == (5, 4, 64, 64) and st.buffers[0]["recurrent"].dtype == torch.float32
    assert st.buffers[0]["conv"].shape == (5, 768, 3) and st.buffers[0]["conv"].dtype == torch.bfloat16
    assert [st.alloc_active(), st.alloc_active(), st.alloc_active()] == [0, 1, None]
    assert [st.alloc_checkpoint() for _ in range(4)] == [2, 3, 4, None]
    st.check_integrity()


def test_state_pool_active_slot_is_zeroed_and_copies_are_exact():
    """A fresh active slot is zero; save then restore reproduces the state bit for bit."""
    st = StatePool(2, 1, KDA, "cpu")
    a = st.alloc_active()
    st.buffers[0]["recurrent"][a].normal_()
    st.buffers[0]["conv"][a].normal_()
    want = {n: b[a].clone() for n, b in st.buffers[0].items()}
    ck = st.alloc_checkpoint()
    st.save(a, ck)
    st.free(a)
    b = st.alloc_active()
    assert b == a and all(buf[b].abs().sum() == 0 for buf in st.buffers[0].values())
    st.restore(ck, b)
    assert all(torch.equal(st.buffers[0][n][b], want[n]) for n in want)


def test_state_pool_rejects_wrong_regions_and_sealed_writes():
    """Copies check the region of each slot and never write a sealed checkpoint."""
    st = StatePool(2, 2, KDA, None)
    a, ck = st.alloc_active(), st.alloc_checkpoint()
    with pytest.raises(ValueError, match="active_slot: slot 2 is a checkpoint slot"):
        st.save(ck, ck)
    with pytest.raises(ValueError, match="checkpoint_slot: slot 0 is an active slot"):
        st.restore(a, a)
    with pytest.raises(ValueError, match="checkpoint_slot: slot 3 is not allocated"):
        st.save(a, 3)
    st.seal(ck)
    with pytest.raises(ValueError, match="sealed"):
        st.save(a, ck)
    st.free(ck)
    assert not st.is_sealed(ck)
    with pytest.raises(ValueError, match="slot: slot 2 is not allocated"):
        st.free(ck)
    st.check_integrity()


def test_state_pool_integrity_detects_corruption():
    """check_integrity fails when a slot is both free and used."""
    st = StatePool(2, 2)
    st.alloc_active()
    st.check_integrity()
    st._free_active.append(0)
    with pytest.raises(IntegrityError):
        st.check_integrity()


@pytest.mark.gpu
def test_pools_on_cuda_copy_bit_exact():
    """On CUDA the pools allocate there, and save then restore reproduces fp32 / bf16 states bit for bit."""
    kv = KVPool(4, 16, MLA, torch.bfloat16, "cuda")
    st = StatePool(2, 2, KDA, "cuda")
    assert kv.buffers[0]["kv"].is_cuda and st.buffers[0]["recurrent"].is_cuda
    a, b, ck = st.alloc_active(), st.alloc_active(), st.alloc_checkpoint()
    for buf in st.buffers[0].values():
        buf[a] = torch.randn(buf.shape[1:], device="cuda").to(buf.dtype)
    st.save(a, ck)
    st.restore(ck, b)
    for buf in st.buffers[0].values():
        assert torch.equal(buf[b], buf[a])
    assert st.buffers[0]["recurrent"].dtype == torch.float32


@pytest.mark.parametrize("page_size, layers, word", [
    (16, MLA, torch.int64),  # pages of 16 x 160 bf16 per layer: copied as 8-byte words
    (1, [{"kv": (1, 161)}, {"kv": (1, 162)}], torch.int16),  # 322 and 324 bytes: only 2-byte words divide both
])
def test_arena_checkpoints_live_in_kv_pages_bit_exact(page_size, layers, word):
    """With an arena, a checkpoint takes ceil(state bytes / page bytes) pages of the KV pool;
    a staged one is written through its row and moved into the pages by seal(), a save()d one
    goes straight there; restore() gives back every layer's state bit for bit, in its own
    dtype; free() returns the pages and the row. The pages are copied as the widest words that
    divide every layer's page bytes."""
    kv = KVPool(40 * 16 // page_size, page_size, layers, torch.bfloat16, "cpu")
    pool = StatePool(2, 1, KDA, "cpu", arena=kv)
    assert all(v.dtype == word for v in pool._views)
    need = -(-state_bytes_per_slot(KDA) // kv.bytes_per_page)
    assert pool.pages_per_checkpoint == need and pool.checkpoint_bytes == need * kv.bytes_per_page
    a, b = pool.alloc_active(), pool.alloc_active()
    g = torch.Generator().manual_seed(0)
    for layer in pool.buffers:
        for buf in layer.values():
            buf[a] = torch.randn(buf[a].shape, generator=g).to(buf.dtype)
    staged = pool.alloc_checkpoint()
    assert kv.num_free == kv.num_pages - need and pool.alloc_checkpoint() is None  # one staging row only
    for layer in pool.buffers:
        for buf in layer.values():
            buf[pool.row(staged)] = buf[a]
    pool.seal(staged)
    with pytest.raises(ValueError, match="no staging row"):
        pool.row(staged)
    direct = pool.alloc_checkpoint(staged=False)
    pool.save(a, direct)
    for layer in pool.buffers:
        for buf in layer.values():
            buf[a].zero_()  # the active slot and the staging row hold nothing of it now
    for ckpt in (staged, direct):
        pool.restore(ckpt, b)
        for layer in pool.buffers:
            for buf in layer.values():
                buf[a] = buf[b]
        assert all(torch.equal(buf[b], buf[a]) for layer in pool.buffers for buf in layer.values())
    ref = {name: buf[b].clone() for layer in pool.buffers for name, buf in layer.items()}
    pool.restore(staged, b)
    assert all(torch.equal(buf[b], ref[name]) for layer in pool.buffers for name, buf in layer.items())
    assert any(buf[b].abs().sum() > 0 for layer in pool.buffers for buf in layer.values())
    pool.check_integrity()
    pool.free(staged)
    pool.free(direct)
    assert kv.num_free == kv.num_pages and pool.num_free_checkpoints == 1 and pool.num_used_checkpoints == 0
    pool.check_integrity()
