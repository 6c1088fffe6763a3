"""The `hybridserve` command (also `python -m hybridserve`): serve | generate | calibrate.

Every engine setting (EngineConfig and its sections) is a flag of each subcommand, generated
from the fields and their help text, spelled with dashes (memory_gb -> --memory-gb;
booleans also take --no-...). The model is the positional argument (or --model).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import types
import typing

from hybridserve.config import OFFLINE_ROUND_TOKENS, OFFLINE_STEP, SECTIONS, EngineConfig
from hybridserve.logs import LEVELS, setup_logging
from hybridserve.sampling import SamplingParams
from hybridserve.server_config import ServerConfig

API_KEY_ENV = "HYBRIDSERVE_API_KEY"
# generate's flags that are absent unless given (EngineConfig.offline fills them in): their type
# and what their help names as the default
OFFLINE_FLAGS: dict[str, tuple[type, str]] = {
    "target_step": (float, "max_step"), "max_step": (float, str(OFFLINE_STEP)),
    "max_round_tokens": (int, str(OFFLINE_ROUND_TOKENS))}


def add_engine_flags(parser: argparse.ArgumentParser, offline: bool = False) -> None:
    """One flag per setting; defaults come from the dataclasses (model: see add_model_arg).
    offline (generate): the OFFLINE_FLAGS default to LLM's offline choices."""
    group = parser.add_argument_group("engine settings")
    hints = {sec: typing.get_type_hints(cls) for sec, cls in ((None, EngineConfig), *SECTIONS.items())}
    unset = OFFLINE_FLAGS if offline else {}
    for name, (sec, f) in EngineConfig.settings().items():
        if name in unset:
            kind, default = unset[name]
            group.add_argument(f"--{name.replace('_', '-')}", type=kind, default=argparse.SUPPRESS,
                               help=f"{f.metadata['help']} (default: {default}; offline, as LLM)")
        elif name != "model":
            add_field_flag(group, f, hints[sec][name], f.default)


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per ServerConfig field."""
    group = parser.add_argument_group("server settings")
    hints = typing.get_type_hints(ServerConfig)
    for f in dataclasses.fields(ServerConfig):
        add_field_flag(group, f, hints[f.name], f.default)


def add_field_flag(group, f: dataclasses.Field, kind, default) -> None:
    """--name-with-dashes for a dataclass field, typed by its annotation, helped by its metadata."""
    if isinstance(kind, types.UnionType):  # X | None
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    flag = "--" + f.name.replace("_", "-")
    choices = f.metadata.get("choices")
    choices = choices() if callable(choices) else choices
    if kind is bool:
        group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=f.metadata["help"])
    else:
        group.add_argument(flag, type=kind, default=default, choices=choices, help=f.metadata["help"])


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The server settings of `serve`; the API key falls back to $HYBRIDSERVE_API_KEY (read
    here, so that --help never prints it)."""
    settings = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig)}
    settings["api_key"] = settings["api_key"] or os.environ.get(API_KEY_ENV)
    return ServerConfig(**settings)


def add_model_arg(parser: argparse.ArgumentParser) -> None:
    help_ = EngineConfig.settings()["model"][1].metadata["help"]
    parser.add_argument("model_pos", nargs="?", metavar="MODEL", help=f"{help_} (default: builtin)")
    parser.add_argument("--model", help="the same as MODEL")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    settings = {name: getattr(args, name) for name in EngineConfig.settings() if name != "model" and name in args}
    # only generate's OFFLINE_FLAGS can be absent (no default): then their offline choices, as LLM's
    offline = any(name not in args for name in OFFLINE_FLAGS)
    return (EngineConfig.offline if offline else EngineConfig.from_settings)(model=args.model, **settings)


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="hybridserve", formatter_class=fmt,
                                     description="Serve linear-attention hybrid LLMs (Kimi-Linear, Qwen3-Next, "
                                                 "NemotronH) with an OpenAI-compatible API.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default="info", choices=LEVELS,
                        help="log level of every hybridserve logger (engine, scheduler, cache, server)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,generate,calibrate}")

    serve = sub.add_parser("serve", formatter_class=fmt, parents=[common], help="run the OpenAI-compatible HTTP server",
                           description="Run the OpenAI-compatible HTTP server (/v1/completions, "
                                       "/v1/chat/completions, /v1/models, /health, /metrics).")
    add_model_arg(serve)
    add_server_flags(serve)
    add_engine_flags(serve)

    gen = sub.add_parser("generate", formatter_class=fmt, parents=[common],
                         help="generate a completion of one prompt and print it",
                         description="Generate a completion of one prompt offline and print its text (a summary "
                                     "line goes to stderr).")
    add_model_arg(gen)
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
    add_engine_flags(gen, offline=True)

    cal = sub.add_parser("calibrate", formatter_class=fmt, parents=[common],
                         help="fit the step-time cost model on this machine",
                         description="Time real forwards of the chosen model on representative prefill and "
                                     "decode shapes, fit the cost model, write it as JSON (usable as "
                                     "--cost-profile) and print its coefficients.")
    add_model_arg(cal)
    cal.add_argument("--output", required=True, help="where to write the profile JSON")
    cal.add_argument("--quick", action="store_true", help="only the cheaper half of the shapes")
    add_engine_flags(cal)
    return parser


def _version() -> str:
    from hybridserve import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model_pos and args.model and args.model_pos != args.model:
        parser.error(f"the model is given twice: {args.model_pos!r} and --model {args.model!r}")
    args.model = args.model_pos or args.model or EngineConfig.model
    setup_logging(args.log_level)
    try:
        config = engine_config(args)
        return COMMANDS[args.command](args, config)
    except ValueError as e:
        print(f"hybridserve {args.command}: error: {e}", file=sys.stderr)
        return 2


def run_serve(args, config: EngineConfig) -> int:
    """Serve until SIGINT / SIGTERM; the exit status is then 128 + the signal's number."""
    from hybridserve.http_server import serve

    return serve(config, server_config(args), args.log_level)


def run_generate(args, config: EngineConfig) -> int:
    from hybridserve.llm import LLM

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed, stop=tuple(args.stop),
                            stop_token_ids=tuple(args.stop_token_ids), ignore_eos=args.ignore_eos)
    llm = LLM(**config.flat())
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
    from dataclasses import asdict

    from hybridserve.calibrate import calibrate
    from hybridserve.engine import Engine
    from scheduler.cost import COEFFS, PROFILES

    shipped = next(PROFILES.glob("*.json")).stem  # any: it only spares the engine its start-up fit
    engine = Engine(config.replace(cost_profile=shipped))
    t0 = time.perf_counter()
    cost = calibrate(engine.model, engine.model_config, engine.memory, engine.cache, quick=args.quick)
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
