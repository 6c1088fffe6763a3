"""Checkpoint admission: which positions of a prefill round or a decode step get a checkpoint."""
import pytest

from state_cache import CacheConfig, CheckpointAdmission, DecodeCheckpoint


def test_prefill_admits_chunk_end_resend_point_and_branch():
    """A round admits its grid-aligned end, the last G-position before the prompt's last token, the branch point."""
    a = CheckpointAdmission(64)
    assert list(a.prefill(0, 128, 300)) == [128]  # a stashed middle chunk
    assert list(a.prefill(128, 300, 300)) == [256]  # last chunk: resend point floor(299 / 64) * 64
    assert list(a.prefill(0, 300, 300, branch_pos=64)) == [64, 256]
    assert list(a.prefill(0, 256, 256)) == [192, 256]  # G-aligned prompt end, and the resend point before it
    assert list(a.prefill(0, 100, 300)) == []  # an arbitrary cut is not checkpointed
    assert list(a.prefill(256, 300, 300, branch_pos=64)) == []  # nothing outside (start, end]
    assert list(a.prefill(0, 50, 50)) == []


def test_prefill_interval_adds_every_interval_tokens():
    """With an interval every multiple of it inside the round is admitted too."""
    a = CheckpointAdmission(64, interval=128)
    assert list(a.prefill(100, 700, 1000)) == [128, 256, 384, 512, 640]
    assert list(a.prefill(0, 1000, 1000)) == list(range(128, 1000, 128)) + [960]


def test_decode_keeps_latest_grid_point_and_interval_points():
    """Decode: off-grid nothing, grid points rolling, interval points kept."""
    a = CheckpointAdmission(64, interval=256)
    assert [a.decode(p) for p in (63, 64, 128, 256, 300)] == [
        DecodeCheckpoint.NONE, DecodeCheckpoint.ROLLING, DecodeCheckpoint.ROLLING,
        DecodeCheckpoint.KEEP, DecodeCheckpoint.NONE,
    ]
    assert CheckpointAdmission(64).decode(256) is DecodeCheckpoint.ROLLING


def test_admission_rejects_bad_arguments():
    """interval must be a multiple of G; a round must lie inside the prompt."""
    with pytest.raises(ValueError, match="interval"):
        CheckpointAdmission(64, interval=96)
    with pytest.raises(ValueError, match="granularity"):
        CheckpointAdmission(0)
    with pytest.raises(ValueError, match="start"):
        list(CheckpointAdmission(64).prefill(10, 5, 20))


def test_each_rule_can_be_switched_off():
    """The configured rules are the only ones: chunk ends, the resend point, branch points and
    the rolling decode point each go when their CacheConfig switch is off."""
    g = 64
    full = CheckpointAdmission.from_config(g, CacheConfig())
    assert list(full.prefill(0, 256, 400, branch_pos=64)) == [64, 256]  # branch point, chunk end
    assert list(full.prefill(192, 300, 300)) == [256]  # the resend point
    for off, want in [({"checkpoint_chunk_ends": "none"}, [64]), ({"checkpoint_branch_points": False}, [256])]:
        a = CheckpointAdmission.from_config(g, CacheConfig(**off))
        assert list(a.prefill(0, 256, 400, branch_pos=64)) == want, off
    no_resend = CheckpointAdmission.from_config(g, CacheConfig(checkpoint_last_prompt="none"))
    assert list(no_resend.prefill(192, 300, 300)) == []
    no_decode = CheckpointAdmission.from_config(g, CacheConfig(checkpoint_decode="none", checkpoint_interval=256))
    assert [no_decode.decode(p) for p in (128, 256)] == [DecodeCheckpoint.NONE, DecodeCheckpoint.KEEP]


def test_prompt_end_floor_and_decode_modes():
    """last_prompt="floor" keeps the prompt's last grid position (for a prompt of k * G tokens
    that is its end, which no lookup capped at len - 1 can use); decode "every" keeps each
    decode grid point, on a coarser decode grid when one is set."""
    floor = CheckpointAdmission.from_config(64, CacheConfig(checkpoint_last_prompt="floor"))
    assert list(floor.prefill(0, 300, 300)) == [256] and list(floor.prefill(0, 256, 256)) == [256]
    assert list(CheckpointAdmission(64).prefill(0, 256, 256)) == [192, 256]  # before-final adds 192
    every = CheckpointAdmission.from_config(64, CacheConfig(checkpoint_decode="every", checkpoint_decode_grid=256))
    assert [every.decode(p) for p in (64, 256, 320, 512)] == [
        DecodeCheckpoint.NONE, DecodeCheckpoint.KEEP, DecodeCheckpoint.NONE, DecodeCheckpoint.KEEP]
    rolling = CheckpointAdmission.from_config(64, CacheConfig(checkpoint_decode_grid=128))
    assert [rolling.decode(p) for p in (64, 128)] == [DecodeCheckpoint.NONE, DecodeCheckpoint.ROLLING]


def test_config_checks_name_the_field():
    """Bad CacheConfig values raise ValueError naming the field."""
    with pytest.raises(ValueError, match="checkpoint_grid"):
        CacheConfig(checkpoint_grid=0)
    with pytest.raises(ValueError, match="checkpoint_interval=192 must be a multiple of checkpoint_grid=128"):
        CacheConfig(checkpoint_grid=128, checkpoint_interval=192)
    with pytest.raises(ValueError, match="checkpoint_decode: 'sometimes'"):
        CacheConfig(checkpoint_decode="sometimes")
    with pytest.raises(ValueError, match="decode_grid must be a positive multiple of granularity=64"):
        CheckpointAdmission(64, decode_grid=96)


def test_each_position_names_the_rule_that_wants_it():
    """prefill() names each position's rule; a chunk end another rule also wants takes that
    rule's kind (so it is not transient), and only chunk ends are transient, when asked."""
    a = CheckpointAdmission(64, hedge=512)
    assert a.prefill(0, 256, 1000, branch_pos=64) == {64: "branch", 256: "chunk"}
    assert a.prefill(256, 960, 1000) == {512: "hedge", 960: "last"}  # 960: chunk end and resend point
    assert a.prefill(960, 1000, 1000) == {}
    assert a.transient_kind == "chunk" and CheckpointAdmission(64, chunk_ends="keep").transient_kind is None



def test_a_host_tier_adds_interval_checkpoints_unless_one_is_set():
    """With a host tier an unset checkpoint_interval becomes HOST_INTERVAL rounded up to the
    grid (states inside long prompts are kept where the host holds them); a set one stays."""
    from state_cache.admission import HOST_INTERVAL

    assert CheckpointAdmission.from_config(64, CacheConfig()).interval is None
    assert CheckpointAdmission.from_config(64, CacheConfig(), host=True).interval == HOST_INTERVAL == 2048
    assert CheckpointAdmission.from_config(1536, CacheConfig(), host=True).interval == 3072
    assert CheckpointAdmission.from_config(64, CacheConfig(checkpoint_interval=512), host=True).interval == 512
    wanted = CheckpointAdmission.from_config(64, CacheConfig(), host=True).prefill(0, 5000, 5000)
    assert [p for p, kind in wanted.items() if kind == "interval"] == [2048, 4096]  # the hedge at 4096 too
