"""What the engine reports per request, and the detokenizer that builds it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from hybridserve.sampling import find_stop

# What Engine.step returns for a request (Engine.add_request's `outputs`):
#   cumulative  every step: all tokens and text so far, and what this step added
#   delta       every step: what it added (prompt_token_ids, token_ids and text left empty, so a
#               stream holds and copies O(tokens), not O(tokens^2), and an engine in another
#               process sends no prompt every step); the last output whole
#   final       the last output only (LLM.generate, as vLLM's FINAL_ONLY), its text decoded once
#               unless stop strings are watched for every step
OUTPUTS = ("cumulative", "delta", "final")


@dataclass(frozen=True)
class CompletionOutput:
    """One completion of a request, as vLLM's `RequestOutput.outputs[i]` reads."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list


@dataclass
class RequestOutput:
    """A request's state after a step; `new_*` fields hold what this step added. `prompt_token_ids`,
    `token_ids`, `text` and `logprobs` are empty in a "delta" request's outputs but its last (OUTPUTS)."""

    rid: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    cached_tokens: int = 0
    # (logprob, top alternatives) per token of token_ids (empty where token_ids is), and per new token
    logprobs: list[tuple[float | None, list | None]] = field(default_factory=list)
    new_logprobs: list[tuple[float | None, list | None]] = field(default_factory=list)

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's view: `out.outputs[0].text` (one completion per request here)."""
        return [CompletionOutput(0, self.text, self.token_ids, self.finish_reason, self.logprobs)]

    @property
    def usage(self) -> dict:
        p, c = len(self.prompt_token_ids), len(self.token_ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


def ids_decoder(tokenizer) -> Callable[[list[int]], str]:
    """`tokenizer.decode` for a list of ids. For a transformers fast tokenizer that neither
    overrides its decode nor cleans up spaces after it, its `tokenizers` backend's decode,
    which gives the same text: the wrapper's argument handling costs ~2 us a call against
    ~0.4 us for the decode itself, and the detokenizer calls it twice per request and step."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    cls = type(tokenizer)
    if (isinstance(tokenizer, TokenizersBackend) and cls.decode is TokenizersBackend.decode
            and cls._decode is TokenizersBackend._decode and not tokenizer.clean_up_tokenization_spaces):
        backend = tokenizer.backend_tokenizer
        return lambda ids: backend.decode(ids, skip_special_tokens=False)
    return tokenizer.decode


class Detokenizer:
    """Incremental text for one request: decodes the output ids and cuts at the first stop
    string (not included).

    `text` is the decoded text so far; `update` returns only what can no longer change: an
    incomplete UTF-8 character and the last len(longest stop) - 1 characters (where a stop
    string completed by a later token may begin) are held back until the request finishes.

    Each update decodes a short window, not every id again (decoding them all each step costs
    O(tokens) a step, O(tokens^2) a request): the ids since `read` with those since `prefix`
    before them as context, and the window's text past the context's is the new text. So a
    tokenizer that decodes a token differently at the start of a string (SentencePiece's
    leading space) or a character split over several tokens (byte-level BPE) is read as a
    decode of the whole output would read it. The window moves on once its text is complete.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...], decode: Callable[[list[int]], str] | None = None):
        self.decode, self.stop = decode or tokenizer.decode, stop  # decode: ids_decoder(tokenizer), made once
        self.hold = max(map(len, stop), default=1) - 1
        self.text = ""
        self.decoded = ""  # text of ids[:read]
        self.prefix = self.read = 0  # the decode window: context ids[prefix:read], then the new ids
        self.sent = 0  # characters of text already returned by update()
        self.stopped = False

    def update(self, ids: list[int], final: bool = False) -> str:
        """Text that became final since the last call (everything left when `final`); nothing
        after a stop string (the text stays cut there)."""
        if self.stopped:
            return ""
        pending = ""
        if len(ids) > self.read:
            context = self.decode(ids[self.prefix : self.read])
            window = self.decode(ids[self.prefix :])
            if len(window) > len(context) and not window.endswith("\ufffd"):  # complete characters
                self.decoded += window[len(context) :]
                self.prefix, self.read = self.read, len(ids)
            else:
                pending = window[len(context) :]  # an incomplete character (shown only at the end)
        full = self.decoded + pending if final else self.decoded
        hit = find_stop(full, self.stop, start=len(self.text))
        if hit is not None:
            full, self.stopped, final = full[:hit], True, True
        self.text = full
        ready = full if final else full[: max(len(full) - self.hold, 0)]
        new = ready[self.sent :]
        self.sent = max(self.sent, len(ready))
        return new
