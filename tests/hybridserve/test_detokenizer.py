"""The incremental detokenizer streams what a decode of the whole output gives, decoding a
short window per step."""
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from hybridserve.outputs import Detokenizer, ids_decoder
from models.builtin import ByteTokenizer

CORPUS = ["héllo wörld, ça va? 你好世界 🙂 naïve café", "def f(x):\n    return x * 2  # π ≈ 3.14",
          "the quick brown fox jumps over the lazy dog"] * 20
CHARS = "abc xyz éüñ 你好 🙂🚀 π≈ \n\t.,"


def byte_level_bpe():
    """GPT-2 style: bytes mapped to symbols, a character can span several tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def sentencepiece_style():
    """Llama style: '▁' for spaces (the first one stripped), byte-fallback tokens for the rest."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>"] + [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=specials))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


class Counting:
    """A tokenizer that counts the ids it is asked to decode."""

    def __init__(self, tok):
        self.tok, self.decoded = tok, 0

    def decode(self, ids):
        self.decoded += len(ids)
        return self.tok.decode(ids)


def stream(tok, ids, decode=None) -> tuple[str, list[str]]:
    d = Detokenizer(tok, (), decode)
    pieces = [d.update(ids[:i], final=i == len(ids)) for i in range(1, len(ids) + 1)]
    return "".join(pieces), pieces


@pytest.mark.parametrize("make", [byte_level_bpe, sentencepiece_style, ByteTokenizer])
def test_streamed_text_is_the_decode_of_the_whole_output(make):
    """Text of mixed scripts and emoji (characters over several tokens or bytes), encoded and
    streamed token by token: the pieces join to the decode of all ids, each piece whole
    characters."""
    tok, rng = make(), random.Random(0)
    for _ in range(150):
        text = "".join(rng.choice(CHARS) for _ in range(rng.randrange(1, 30)))
        ids = list(tok.encode(text))
        streamed, pieces = stream(tok, ids)
        assert streamed == tok.decode(ids)
        assert not any(p.endswith("\ufffd") for p in pieces[:-1])


def test_byte_level_random_ids_stream_their_decode():
    """Any ids, invalid UTF-8 runs included, under a byte-level tokenizer."""
    tok, rng = byte_level_bpe(), random.Random(1)
    for _ in range(150):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
        assert stream(tok, ids)[0] == tok.decode(ids)


def test_each_step_decodes_a_window_not_the_whole_output():
    """1,000 ASCII tokens: the ids decoded over all steps grow linearly (a few per step), where
    decoding the whole output every step would decode half a million."""
    tok = Counting(ByteTokenizer())
    ids = list(ByteTokenizer().encode("x = 1\n" * 167))[:1000]
    streamed, _ = stream(tok, ids)
    assert streamed == ByteTokenizer().decode(ids)
    assert tok.decoded <= 4 * len(ids)


@pytest.mark.parametrize("make", [byte_level_bpe, sentencepiece_style])
def test_backend_decoder_reads_as_the_tokenizer(make):
    """Where `ids_decoder` takes the fast tokenizer's backend (spaces not cleaned up), it
    decodes any ids, specials and invalid UTF-8 runs included, as `tokenizer.decode` does, and
    streams the same pieces; where the tokenizer cleans up spaces it is `tokenizer.decode`."""
    tok, rng = make(), random.Random(2)
    tok.clean_up_tokenization_spaces = False
    decode = ids_decoder(tok)
    assert decode != tok.decode  # the backend's
    for _ in range(200):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(0, 40))]
        assert decode(ids) == tok.decode(ids)
        if ids:
            assert stream(tok, ids, decode) == stream(tok, ids)  # piece by piece
    tok.clean_up_tokenization_spaces = True
    assert ids_decoder(tok) == tok.decode
    byte = ByteTokenizer()
    assert ids_decoder(byte) == byte.decode


@pytest.mark.parametrize("make", [byte_level_bpe, sentencepiece_style, ByteTokenizer])
def test_stop_strings_cut_the_stream_where_the_output_first_holds_one(make):
    """Random texts and stop strings taken from them (several, overlapping, some spanning tokens):
    the streamed pieces join to the text of the first prefix of the ids whose decode holds a
    stop string, cut before the earliest one in it (a stop string that starts earlier but ends
    later is not waited for); `text` is what was returned plus what is held back at every step;
    nothing is returned past the stop."""
    tok, rng = make(), random.Random(3)
    for _ in range(150):
        text = "".join(rng.choice(CHARS) for _ in range(rng.randrange(2, 40)))
        ids = list(tok.encode(text))
        whole = tok.decode(ids)
        if "\ufffd" in whole or len(whole) < 2:
            continue
        stops = []
        for _ in range(rng.randrange(1, 4)):
            a = rng.randrange(len(whole))
            stops.append(whole[a: a + rng.randrange(1, 5)])
        stops.append("never \u2603\u2603")
        for i in range(1, len(ids) + 1):  # the first prefix (its complete characters) holding a stop
            seen = tok.decode(ids[:i]).rstrip("\ufffd")
            if any(s in seen for s in stops):
                want = seen[: min(seen.find(s) for s in stops if s in seen)]
                break
        d, pieces = Detokenizer(tok, tuple(stops)), []
        for i in range(1, len(ids) + 1):
            pieces.append(d.update(ids[:i], final=i == len(ids)))
            assert d.text.startswith("".join(pieces))
            if d.stopped:
                break
        assert "".join(pieces) == d.text == want and d.stopped
        assert d.update(ids, final=True) == "" and d.text == want
