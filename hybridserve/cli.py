"""The `hybridserve` command: serve | generate | calibrate.

Every EngineConfig field is a flag of each subcommand, spelled with dashes
(memory_gb -> --memory-gb; booleans also take --no-...).
"""
from __future__ import annotations

import argparse
import sys
import time
import types
import typing
from dataclasses import MISSING, fields

from hybridserve.config import DTYPES, EngineConfig
from hybridserve.sampling import SamplingParams
from scheduler.policy import POLICIES
from state_cache import policy_names

ENGINE_HELP = {
    "model": "checkpoint folder in the Hugging Face layout (config.json + safetensors + tokenizer), or "
             "'builtin' for the small random-weight Kimi-Linear model with a byte tokenizer",
    "device": "torch device to run on, e.g. cpu or cuda:0",
    "dtype": "weight and KV dtype; auto keeps the checkpoint's",
    "page_size": "tokens per attention-KV page",
    "memory_gb": "GiB for the KV pages, the active state slots and the checkpoint slots together",
    "checkpoint_share": "share of the memory left after the active slots that goes to recurrent-state "
                        "checkpoints (the prefix cache of the linear layers); the rest is KV pages",
    "max_running": "most requests admitted at once (one active state slot each)",
    "max_model_len": "longest prompt + output in tokens; unset: the model's context",
    "policy": "scheduling policy: tokens (fixed token budget, prefill first), budget (token budget shared "
              "with decode), serial (fill each round up to --target-step predicted seconds), serial+deadline "
              "(serial, earliest TTFT deadline first; late requests get bigger chunks up to --max-step)",
    "token_budget": "tokens per round under the tokens and budget policies",
    "target_step": "seconds of predicted step time per round under the serial policies",
    "max_step": "cap on a round's predicted seconds when serial+deadline grows a late request's chunk",
    "mixed_chunk": "tokens policy: let decode rows ride along with prefill chunks",
    "cost_profile": "step-time model for the serial policies: a shipped profile name or a JSON file from "
                    "`hybridserve calibrate`; unset: fit one at start-up from a few timed forwards",
    "enable_prefix_cache": "resume requests from cached prefixes (KV + state checkpoints)",
    "eviction": "prefix-cache eviction policy: lru, or utility (FLOPs saved per byte, blended with recency)",
    "checkpoint_interval": "also checkpoint every N tokens (a multiple of the checkpoint grid); unset: only "
                           "at chunk ends, branch points and before the last prompt token",
    "decode_reserve": "share of each request's max_tokens whose KV pages admission reserves (1: admit only "
                      "what surely fits; lower admits more and retracts when the pool runs short)",
    "seed": "seed for torch (sampling of requests without their own seed)",
    "debug_integrity": "check every pool's integrity whenever the engine is idle (slow; for debugging)",
}
CHOICES = {"dtype": DTYPES, "policy": POLICIES, "eviction": tuple(policy_names())}


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine (EngineConfig)")
    hints = typing.get_type_hints(EngineConfig)
    for f in fields(EngineConfig):
        kind = hints[f.name]
        if isinstance(kind, types.UnionType):  # X | None
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not MISSING else None
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=ENGINE_HELP[f.name])
        else:
            group.add_argument(flag, type=kind, default=default, choices=CHOICES.get(f.name), help=ENGINE_HELP[f.name])


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{name: getattr(args, name) for name in EngineConfig.names()})


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="hybridserve", formatter_class=fmt,
                                     description="Serve linear-attention hybrid LLMs (Kimi-Linear, Qwen3-Next, "
                                                 "NemotronH) with an OpenAI-compatible API.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,generate,calibrate}")

    serve = sub.add_parser("serve", formatter_class=fmt, help="run the OpenAI-compatible HTTP server",
                           description="Run the OpenAI-compatible HTTP server (/v1/completions, "
                                       "/v1/chat/completions, /v1/models, /health, /metrics).")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all interfaces)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    serve.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                       help="uvicorn's log level")
    add_engine_flags(serve)

    gen = sub.add_parser("generate", formatter_class=fmt, help="generate a completion of one prompt and print it",
                         description="Generate a completion of one prompt offline and print its text (a summary "
                                     "line goes to stderr).")
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    d = SamplingParams()
    gen.add_argument("--max-tokens", type=int, default=d.max_tokens, help="most tokens to generate")
    gen.add_argument("--temperature", type=float, default=d.temperature, help="sampling temperature (0: greedy)")
    gen.add_argument("--top-p", type=float, default=d.top_p, help="nucleus sampling mass (1: off)")
    gen.add_argument("--top-k", type=int, default=d.top_k, help="sample among the k most likely tokens (0: off)")
    gen.add_argument("--sampling-seed", type=int, default=d.seed, help="seed of this request's sampling")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeat for several); not printed")
    gen.add_argument("--stop-token-ids", type=int, nargs="*", default=[], help="token ids that end generation")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    add_engine_flags(gen)

    cal = sub.add_parser("calibrate", formatter_class=fmt, help="fit the step-time cost model on this machine",
                         description="Time real forwards of the chosen model on representative prefill and "
                                     "decode shapes, fit the cost model, write it as JSON (usable as "
                                     "--cost-profile) and print its coefficients.")
    cal.add_argument("--output", required=True, help="where to write the profile JSON")
    cal.add_argument("--quick", action="store_true", help="only the cheaper half of the shapes")
    add_engine_flags(cal)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = engine_config(args)
        return COMMANDS[args.command](args, config)
    except ValueError as e:
        print(f"hybridserve {args.command}: error: {e}", file=sys.stderr)
        return 2


def run_serve(args, config: EngineConfig) -> int:
    from hybridserve.server import serve

    serve(config, args.host, args.port, args.log_level)
    return 0


def run_generate(args, config: EngineConfig) -> int:
    from hybridserve.engine import LLM

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed, stop=tuple(args.stop),
                            stop_token_ids=tuple(args.stop_token_ids), ignore_eos=args.ignore_eos)
    llm = LLM(**vars(config))
    prompt = args.prompt
    if args.chat:
        tok = llm.engine.tokenizer
        msgs = [{"role": "user", "content": prompt}]
        prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) \
            if hasattr(tok, "chat_template") else tok.apply_chat_template(msgs)
    t0 = time.perf_counter()
    (out,) = llm.generate(prompt, params)
    dt = time.perf_counter() - t0
    print(out.text)
    u = out.usage
    print(f"[{u['prompt_tokens']} prompt tokens, {u['completion_tokens']} generated, finish_reason="
          f"{out.finish_reason}, {dt:.2f} s, {u['completion_tokens'] / dt:.1f} tok/s]", file=sys.stderr)
    return 0


def run_calibrate(args, config: EngineConfig) -> int:
    from dataclasses import asdict, replace

    from hybridserve.calibrate import calibrate
    from hybridserve.engine import Engine
    from scheduler.cost import COEFFS, PROFILES

    shipped = next(PROFILES.glob("*.json")).stem  # any: it only spares the engine its start-up fit
    engine = Engine(replace(config, cost_profile=shipped))
    t0 = time.perf_counter()
    cost = calibrate(engine.model, engine.model_config, engine.memory, engine.scheduler.mem.cache, quick=args.quick)
    cost.to_json(args.output)
    values = asdict(cost)
    print(f"wrote {args.output} ({time.perf_counter() - t0:.1f} s of timing)")
    for name in COEFFS:
        print(f"  {name:<11} {values[name]:.6g}")
    print(f"  chunk={cost.chunk} attn_layers={cost.attn_layers}")
    return 0


COMMANDS = {"serve": run_serve, "generate": run_generate, "calibrate": run_calibrate}

if __name__ == "__main__":
    sys.exit(main())
