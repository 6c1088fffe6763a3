"""What the engine reports per request, and the detokenizer that builds it."""
from __future__ import annotations

from dataclasses import dataclass, field

from hybridserve.sampling import find_stop


@dataclass
class RequestOutput:
    """A request's state after a step; `new_*` fields hold what this step added."""

    rid: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    cached_tokens: int = 0
    logprobs: list[tuple[float | None, list | None]] = field(default_factory=list)  # per new token

    @property
    def usage(self) -> dict:
        p, c = len(self.prompt_token_ids), len(self.token_ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


class Detokenizer:
    """Incremental text for one request: decodes the output ids, holds back an incomplete
    UTF-8 tail, and cuts at the first stop string (which is not included)."""

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.tokenizer, self.stop = tokenizer, stop
        self.text = ""
        self.stopped = False

    def update(self, ids: list[int]) -> str:
        """New text since the last call (empty while a multi-byte character is incomplete)."""
        full = self.tokenizer.decode(ids)
        if full.endswith("\ufffd"):
            full = full.rstrip("\ufffd")  # wait for the rest of the character
        hit = find_stop(full, self.stop, start=len(self.text))
        if hit is not None:
            full, self.stopped = full[:hit], True
        new = full[len(self.text):] if full.startswith(self.text) else full
        self.text = full
        return new
