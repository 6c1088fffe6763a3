"""LLM: offline generation in the style of vLLM.

    llm = LLM("builtin")                      # or a checkpoint folder; settings as keywords
    outs = llm.generate(["def f(x):", {"prompt_token_ids": [100, 101]}], SamplingParams(max_tokens=32))
"""
from __future__ import annotations

from typing import Sequence

from hybridserve.config import EngineConfig
from hybridserve.engine import Engine, Prompt
from hybridserve.outputs import RequestOutput
from hybridserve.sampling import SamplingParams


class LLM:
    """`LLM(model, **settings)`: an Engine built from flat setting names (EngineConfig), offline:
    its rounds fill up to `max_step` (1 s unless given: config.OFFLINE_STEP) unless `target_step`
    (or a `scheduler` section) is given (EngineConfig.offline): fewer, larger rounds than the server's,
    of at most `max_round_tokens` tokens (config.OFFLINE_ROUND_TOKENS unless given)."""

    def __init__(self, model: str = "builtin", **settings):
        self.engine = Engine(EngineConfig.offline(model=model, **settings))

    def close(self) -> None:
        """Stop a multi-rank engine's workers, if any (also on leaving a `with` block)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order.

        Every prompt is validated before any is queued (a ValueError leaves nothing behind),
        and if generation fails the requests of this call are aborted.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = params or SamplingParams()
        per = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per) != len(prompts):
            raise ValueError(f"params: {len(per)} SamplingParams for {len(prompts)} prompts")
        engine = self.engine
        ids = []
        for i, (p, sp) in enumerate(zip(prompts, per)):
            try:
                ids.append(engine.validate(p, sp))
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from None
        rids = [engine.add_request(x, sp, outputs="final") for x, sp in zip(ids, per)]
        done: dict[str, RequestOutput] = {}
        try:
            while len(done) < len(rids):
                for o in engine.step():
                    if o.finished:
                        done[o.rid] = o
        finally:
            for rid in rids:
                if rid not in done:
                    engine.abort(rid)
        return [done[r] for r in rids]
