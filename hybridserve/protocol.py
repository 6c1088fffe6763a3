"""OpenAI request bodies (pydantic: unknown fields allowed, wrong types rejected, strictly:
"5" is not an integer) and what the server makes of them: the engine prompt, the
SamplingParams, the logprobs objects of the responses; and the OpenAI error shape."""
from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar, Mapping, cast

from pydantic import BaseModel, ConfigDict, ValidationError

from hybridserve.outputs import RequestOutput
from hybridserve.sampling import SamplingParams

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# union-typed fields: what a value must be, for error messages
EXPECTED = {
    "prompt": "a string or a list of token ids (a list holding one of those is accepted too)",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts",
}
BUILTIN_TYPES = {"str", "int", "float", "bool", "list", "dict", "none"}
MAX_MESSAGE = 1000  # characters of an error message; the rest is cut (never echo a huge input)


class APIError(Exception):
    """An HTTP error in the OpenAI shape {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: Mapping[str, str] | None = None):
        if len(message) > MAX_MESSAGE:
            message = f"{message[:MAX_MESSAGE]}... (message cut, {len(message)} characters)"
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Body):
    include_usage: bool | None = None


class SamplingRequest(_Body):
    """The fields /v1/completions and /v1/chat/completions share (None: the default), and
    what differs between them as class constants and methods."""

    id_prefix: ClassVar[str]
    object_name: ClassVar[str]
    chunk_object_name: ClassVar[str]

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @abstractmethod
    def engine_prompt(self, tokenizer) -> str | list[int]:
        """The prompt the engine takes: text or token ids (ValueError for unsupported input)."""

    @abstractmethod
    def choice(self, text: str, finish_reason: str | None, logprobs: dict | None, first: bool | None = None) -> dict:
        """choices[0] of a response (first=None) or of a stream chunk."""

    @abstractmethod
    def format_logprobs(self, tokenizer, *outs: RequestOutput) -> dict:
        """The logprobs object of a response or of a stream chunk, for outs' new tokens."""

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """ValueError naming the field for values the engine does not support."""
        if self.n not in (None, 1):
            raise ValueError(f"n: only n=1 is supported, got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                raise ValueError(f"{name}: not supported (must be 0 or absent), got {getattr(self, name)}")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        given: dict[str, Any] = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                     seed=self.seed, ignore_eos=self.ignore_eos)
        return SamplingParams(max_tokens=self.max_new_tokens(default_max_tokens), stop=stop,
                              stop_token_ids=tuple(self.stop_token_ids or ()), logprobs=self.logprob_count(),
                              **{k: v for k, v in given.items() if v is not None})

    def max_new_tokens(self, default: int) -> int:
        return self.max_tokens if self.max_tokens is not None else default

    def logprob_count(self) -> int | None:
        return None

    @property
    def wants_logprobs(self) -> bool:
        return self.logprob_count() is not None


class CompletionRequest(SamplingRequest):
    id_prefix: ClassVar[str] = "cmpl"
    object_name: ClassVar[str] = "text_completion"
    chunk_object_name: ClassVar[str] = "text_completion"

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None

    def choice(self, text: str, finish_reason: str | None, logprobs: dict | None, first: bool | None = None) -> dict:
        """choices[0] of a response (first=None) or of a stream chunk."""
        return {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}

    def engine_prompt(self, tokenizer) -> str | list[int]:
        if self.echo:
            raise ValueError("echo: not supported")
        p = self.prompt
        if isinstance(p, list) and p and isinstance(first := p[0], (str, list)):
            if len(p) > 1:
                raise ValueError(f"prompt: a list of {len(p)} prompts is not supported; send one prompt per request")
            return first
        return cast("str | list[int]", p)  # not a list of prompts: a string or token ids

    def max_new_tokens(self, default: int) -> int:
        return self.max_tokens if self.max_tokens is not None else COMPLETION_MAX_TOKENS

    def logprob_count(self) -> int | None:
        return self.logprobs

    def format_logprobs(self, tokenizer, *outs: RequestOutput) -> dict:
        """The legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset."""
        rows = _logprob_rows(tokenizer, outs)
        offsets, at = [], 0
        for text, _, _ in rows:
            offsets.append(at)
            at += len(text)
        return {"tokens": [t for t, _, _ in rows], "token_logprobs": [lp for _, lp, _ in rows],
                "top_logprobs": [dict(top) for _, _, top in rows] if self.logprobs else None,
                "text_offset": offsets}


class ContentPart(_Body):
    type: str
    text: str | None = None


class Message(_Body):
    role: str
    content: str | list[ContentPart] | None = None

    def text(self, index: int) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = [p.text for p in self.content if p.type == "text" and p.text is not None]
        if len(texts) != len(self.content):
            raise ValueError(f"messages[{index}].content: only parts of type 'text' are supported")
        return "".join(texts)


class ChatRequest(SamplingRequest):
    id_prefix: ClassVar[str] = "chatcmpl"
    object_name: ClassVar[str] = "chat.completion"
    chunk_object_name: ClassVar[str] = "chat.completion.chunk"

    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def choice(self, text: str, finish_reason: str | None, logprobs: dict | None, first: bool | None = None) -> dict:
        """choices[0] of a response (first=None) or of a stream chunk (the first carries the role)."""
        if first is None:
            body = {"message": {"role": "assistant", "content": text}}
        else:
            body = {"delta": {"role": "assistant", "content": text} if first else {"content": text}}
        return {"index": 0, **body, "finish_reason": finish_reason, "logprobs": logprobs}

    def engine_prompt(self, tokenizer) -> str | list[int]:
        """The chat template's text (built-in tokenizer) or its token ids (a transformers
        tokenizer; the template already holds the special tokens)."""
        if not self.messages:
            raise ValueError("messages: must not be empty")
        msgs = [{"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages)]
        if not hasattr(tokenizer, "chat_template"):
            return tokenizer.apply_chat_template(msgs)
        if not tokenizer.chat_template:
            raise ValueError("messages: this model has no chat template; use /v1/completions")
        try:
            text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # the template's own checks (roles, order) raise its errors
            raise ValueError(f"messages: the chat template rejected them: {e}") from None
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def max_new_tokens(self, default: int) -> int:
        return next((v for v in (self.max_completion_tokens, self.max_tokens) if v is not None), default)

    def logprob_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs=true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def format_logprobs(self, tokenizer, *outs: RequestOutput) -> dict:
        """The chat shape: content = [{token, logprob, bytes, top_logprobs}]."""
        def entry(text, lp):
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**entry(text, lp), "top_logprobs": [entry(t, v) for t, v in top]}
                            for text, lp, top in _logprob_rows(tokenizer, outs)]}


def _logprob_rows(tokenizer, outs) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """(token text, logprob, [(alternative text, logprob)]) for each new token of outs."""
    rows = []
    for out in outs:
        for tid, (lp, top) in zip(out.new_token_ids, out.new_logprobs):
            rows.append((tokenizer.decode([tid]), lp, [(tokenizer.decode([t]), v) for t, v in top or ()]))
    return rows


def describe_validation_error(e: ValidationError) -> tuple[str, str]:
    """(param, message) for the first field that failed, e.g. ("temperature", "temperature:
    Input should be a valid number")."""
    errors = e.errors()
    path = _path(errors[0]["loc"])
    same = [x for x in errors if _path(x["loc"]).split(".")[0] == path.split(".")[0]]
    leaf = next((p for p in reversed(path.split(".")) if not p.isdigit()), path)
    if len(same) > 1 and leaf in EXPECTED:
        return path, f"{path}: must be {EXPECTED[leaf]}"
    msg = errors[0]["msg"]
    if errors[0]["type"] == "missing":
        msg = "this field is required"
    return path, f"{path}: {msg}"


def _path(loc: tuple) -> str:
    """A field path without pydantic's union-member tags: ("prompt", "list[int]", 1) -> "prompt.1"."""
    parts = [str(x) for x in loc if isinstance(x, int) or ("[" not in x and x not in BUILTIN_TYPES)]
    return ".".join(parts) or "body"
