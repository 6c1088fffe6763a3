import pytest
import torch

from hybridserve.sampling import Sampler, SamplingParams, argmax_rows, filter_logits, find_stop


def test_greedy_is_argmax():
    """temperature 0 picks the argmax of every row."""
    logits = torch.randn(5, 50)
    out = Sampler()(logits, [SamplingParams(temperature=0)] * 5, range(5))
    assert out.tokens == logits.argmax(-1).tolist()


def test_argmax_rows_picks_torchs_index_on_ties_nan_and_inf():
    """The CPU argmax picks the index torch's does: the first of equal maxima, the first NaN, the
    first of an all -inf row; on random logits (bf16-rounded, so ties occur) as well."""
    nan, inf = float("nan"), float("inf")
    rows = torch.tensor([[1., 3., 3., 0.], [nan, 5., nan, 1.], [1., nan, 9., 9.], [-inf] * 4, [2.] * 4,
                         [0., 0., inf, inf]])
    ties = torch.randn(64, 4096, generator=torch.Generator().manual_seed(0)).bfloat16().float()
    for logits in (rows, ties, ties[:, ::3]):
        assert torch.equal(argmax_rows(logits), logits.argmax(-1))


def test_seed_reproducible_regardless_of_batch():
    """A seeded request samples the same tokens alone or batched with others."""
    torch.manual_seed(0)
    rows = [torch.randn(2, 64) for _ in range(6)]
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    alone, s1 = [], Sampler()
    for r in rows:
        alone.append(s1(r[:1], [p], ["a"]).tokens[0])
    batched, s2 = [], Sampler()
    other = SamplingParams(temperature=1.0)
    for r in rows:
        batched.append(s2(r, [p, other], ["a", "b"]).tokens[0])
    assert alone == batched


def test_top_k_and_top_p_restrict_support():
    """Samples never fall outside the top-k set, nor outside the top-p nucleus."""
    logits = torch.tensor([[5.0, 4.0, 3.0, -1.0, -2.0, -3.0]] * 200)
    s = Sampler()
    toks = s(logits, [SamplingParams(temperature=1.0, top_k=2, seed=i) for i in range(200)], range(200)).tokens
    assert set(toks) <= {0, 1} and len(set(toks)) == 2
    row = filter_logits(logits[0], 0, 0.7)  # p = [.665, .245, .09, ...]: nucleus {0, 1}
    assert torch.isfinite(row).tolist() == [True, True, False, False, False, False]


def test_logprobs_of_sampled_and_top():
    """logprobs returns the sampled token's log-probability and the top alternatives in order."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    out = Sampler()(logits, [SamplingParams(temperature=0, logprobs=2)], [0])
    ref = torch.log_softmax(logits[0], -1)
    assert out.tokens == [0] and out.logprobs[0] == pytest.approx(float(ref[0]))
    assert [t for t, _ in out.top_logprobs[0]] == [0, 1]


@pytest.mark.parametrize("field,value", [("max_tokens", 0), ("temperature", -1.0), ("temperature", float("nan")),
                                         ("top_p", 0.0), ("top_k", -5), ("logprobs", 99), ("seed", -1),
                                         ("stop", ("",)), ("stop_token_ids", (-3,))])
def test_bad_values_name_the_field(field, value):
    """Out-of-range sampling values raise ValueError naming the field."""
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_find_stop_only_in_new_text():
    """Stop strings are found at their earliest position, including across the old/new boundary."""
    assert find_stop("hello world", ["wor"], start=6) == 6
    assert find_stop("hello world", ["lo w"], start=5) == 3
    assert find_stop("hello world", ["hello"], start=8) is None
    assert find_stop("abc", [], 0) is None


def test_detokenizer_never_streams_text_a_stop_string_takes_back():
    """Streamed pieces concatenate to the final text even when a stop string begins inside
    text decoded by an earlier token (the tail that could start one is held back)."""
    from hybridserve.outputs import Detokenizer
    from models.builtin import ByteTokenizer

    tok = ByteTokenizer()
    ids = tok.encode("hello wor") + tok.encode("ld and more")
    d, pieces = Detokenizer(tok, ("world",)), []
    for i in range(1, len(ids) + 1):
        pieces.append(d.update(ids[:i]))
        if d.stopped:
            break
    assert d.text == "hello " and "".join(pieces) == "hello "
    d2 = Detokenizer(tok, ())
    streamed = "".join(d2.update(ids[:i], final=i == len(ids)) for i in range(1, len(ids) + 1))
    assert streamed == "hello world and more"
    euro = "€".encode()  # 3 bytes: nothing is streamed until the character is complete
    d3 = Detokenizer(tok, ())
    assert [d3.update(list(euro[:i])) for i in (1, 2, 3)] == ["", "", "€"]
