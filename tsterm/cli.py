"""`tsterm` command line. Exit codes: 0 ok, 1 runtime error, 2 usage/config error."""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Collection
from typing import Any

from tsterm.errors import TstermError


SAMPLING_FLAGS = {"temperature": "--temperature", "max_tokens": "--max-tokens", "top_p": "--top-p", "top_k": "--top-k",
                  "seed": "--seed"}


def _sampling_params(args: argparse.Namespace, profile: Any, model_defaults: dict[str, Any] | None = None):
    """The flags over the profile's sampling, or over the model's own (its generation_config.json)."""
    from tsterm.config import SamplingParams

    sampling = {**(model_defaults or {}), **(profile.sampling if profile else {})}
    for key in SAMPLING_FLAGS:
        if getattr(args, key, None) is not None:
            sampling[key] = getattr(args, key)
    return SamplingParams(**sampling)


def _model_sampling(args: argparse.Namespace, profile: Any, llm: Any, system: str | None):
    """The reply's sampling once the model is loaded; without a profile, one stderr line says which defaults it got
    and where from, and which system prompt (a chat template may write its own: SmolLM2's does)."""
    from tsterm.config import generation_defaults

    if profile is not None:  # a profile's sampling is whole: its keys over tsterm's defaults
        return _sampling_params(args, profile)
    model_defaults = generation_defaults(llm.config.model)
    params = _sampling_params(args, None, model_defaults)
    flags = ", ".join(flag for key, flag in SAMPLING_FLAGS.items() if getattr(args, key, None) is not None)
    from_model = any(getattr(args, key, None) is None for key in model_defaults)
    sources = "; ".join(filter(None, (flags, f"{llm.config.model}/generation_config.json" if from_model else "")))
    note = (f"sampling temperature {params.temperature:g}, top_p {params.top_p:g}, top_k {params.top_k}, "
            f"max_tokens {params.max_tokens} ({sources or 'tsterm defaults'})")
    if not getattr(args, "raw", False) and system is None:
        own = llm.tokenizer.default_system_prompt()
        note += (f"; the chat template's own system prompt ({own!r})" if own else "; no system prompt") + \
            " (--system, or a --profile, sets one)"
    print(f"tsterm: no profile: {note}", file=sys.stderr)
    return params


def cmd_run(args: argparse.Namespace) -> int:
    from tsterm.launch import llm_from_args, profile_from_args

    args.prompt = _prompt_text(args.prompt)
    profile = profile_from_args(args)
    _sampling_params(args, profile)  # validated before the (possibly long) model load
    llm = llm_from_args(args, profile)
    system = args.system if args.system is not None else (profile.system_prompt if profile else None)
    params = _model_sampling(args, profile, llm, system)
    if args.raw:
        prompt: Any = args.prompt
    else:
        messages = []
        if system:
            messages.append({"role": "system", "content": system})
        messages.append({"role": "user", "content": args.prompt})
        prompt = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)

    def stream(out) -> None:
        if not args.json and out.outputs[0].delta_text:
            sys.stdout.write(out.outputs[0].delta_text)
            sys.stdout.flush()

    out = llm.generate(prompt, params, on_output=stream)[0]
    if args.json:
        m, stats = out.metrics, llm.stats()
        json.dump({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                   "prompt_tokens": len(out.prompt_token_ids), "cached_tokens": out.num_cached_tokens,
                   "ttft_s": m.ttft, "e2e_s": m.e2e, "mean_itl_s": m.mean_itl,
                   **{key: stats[key] for key in ("spec_num_drafts", "spec_draft_tokens", "spec_accepted_tokens",
                                                  "spec_accepted_per_pos")}}, sys.stdout)
    sys.stdout.write("\n")
    return 0


def _prompt_text(prompt: str | None) -> str:
    """--prompt TEXT; `-`, or no --prompt on a pipe, reads stdin (`cat notes.txt | tsterm run --prompt -`). The
    newline that ends piped text is not part of the message. stdin is read only when asked or piped: a --prompt
    given never waits on a stdin that stays open."""
    if prompt is not None and prompt != "-":
        _require_text(prompt, "--prompt")
        return prompt
    if prompt is None and (sys.stdin is None or sys.stdin.isatty()):
        from tsterm.errors import ConfigError
        raise ConfigError("no prompt: give --prompt TEXT, or pipe the text in (`--prompt -` reads stdin)")
    text = sys.stdin.read().rstrip("\r\n")
    if not text.strip():
        from tsterm.errors import ConfigError
        raise ConfigError("the prompt read from stdin is empty: pipe in the text to send, or give --prompt TEXT")
    return text


def _require_text(text: str, what: str) -> None:
    """An empty or blank prompt is a usage error: the model would invent a long reply to nothing."""
    if not text.strip():
        from tsterm.errors import ConfigError
        raise ConfigError(f"{what} is empty: give the text to send (e.g. {what} \"What is the capital of France?\")")


def cmd_chat(args: argparse.Namespace) -> int:
    """Line mode (tsterm.chat.line_chat) on a pipe or with --plain; else the TUI."""
    if not args.plain and not args.model and sys.stdin.isatty():
        from tsterm.tui import main as tui
        return tui(args.profile or "default", engine_options=_parallel_options(args))
    from tsterm.chat import line_chat
    from tsterm.launch import llm_from_args, profile_from_args
    from tsterm.profiles import DEFAULT_THINKING_HISTORY

    if not args.model and not args.profile:
        args.profile = "default"
    profile = profile_from_args(args)
    _sampling_params(args, profile)  # validated before the model load
    llm = llm_from_args(args, profile)
    system = args.system if args.system is not None else (profile.system_prompt if profile else None)
    policy = args.thinking_history or (profile.thinking_history if profile else DEFAULT_THINKING_HISTORY)
    from tsterm.agent.harmony import chat_format  # harmony for gpt-oss, else the checkpoint's template

    return line_chat.run(llm, _model_sampling(args, profile, llm, system), system, history_policy=policy,
                         chat_format=chat_format(llm.tokenizer))


def _parallel_options(args: argparse.Namespace) -> dict[str, int | str | None]:
    """The engine flags `add_parallel_arguments` adds (parallel sizes, quantization, speculation), for the TUI's
    engine."""
    return {name: getattr(args, name, None) for name in ("tensor_parallel_size", "expert_parallel_size",
                                                         "quantization", "speculative_method",
                                                         "num_speculative_tokens")}


def cmd_profiles(args: argparse.Namespace) -> int:
    from tsterm.profiles import list_profiles, load_profile

    if args.action == "list":
        rows = list_profiles()
        width = max((len(name) for name, _, _ in rows), default=0)
        for name, description, path in rows:
            print(f"{name:<{width}}  {description}  ({path})")
    elif args.action == "show":
        profile = load_profile(args.profile_name)
        _warn(profile.kv_budget_warnings())
        print(f"# {profile.path}")
        sys.stdout.write(profile.to_yaml())
    else:
        from tsterm.agent.toolset import check_toolset
        from tsterm.profiles import check_profile

        profile, problems = check_profile(args.profile_name)  # every error of the file, in file order
        for problem in problems:
            print(f"tsterm: error: {problem}", file=sys.stderr)
        if problems:
            return 2
        if profile.agent:  # command tools and MCP servers in full (the workspace must exist); starts nothing
            check_toolset(profile.agent_settings(), where=f"{profile.path}: agent")
        _warn(profile.kv_budget_warnings())
        print(f"ok: {profile.path}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """`tsterm plan`; --profile names the config the planner reads (tsterm.plan knows models, not profiles)."""
    from tsterm.errors import ConfigError
    from tsterm.plan import main as plan

    profile = getattr(args, "profile", None)
    if profile is not None:
        if args.model is not None:
            raise ConfigError("give --model or --profile, not both")
        from tsterm.profiles import load_profile
        # the model's directory may be a ${VAR} left unset where only its config is at hand
        args.model = load_profile(profile, strict_env=False).planning_config()
    return plan(args)


def cmd_info(args: argparse.Namespace) -> int:
    """`tsterm info`: the CPU, the C builds, the dtype `auto` resolves to and why, and each shape class's kernel."""
    from tsterm.errors import ConfigError
    from tsterm.launch import engine_options, profile_from_args

    if args.model is not None and getattr(args, "profile", None) is not None:
        raise ConfigError("give --model or --profile, not both")
    if args.model is None and getattr(args, "profile", None) is None:
        args.profile = "default"
    model_dir, options = engine_options(profile_from_args(args), args.model, dtype=args.dtype, device=args.device,
                                        quantization=args.quantization)
    from tsterm.engine.machine_info import format_info, machine_info  # torch: loaded once the model is found

    report = machine_info(model_dir, options, measure=args.measure)
    print(json.dumps(report, indent=1) if args.json else format_info(report))
    return 0


def _warn(warnings: list[str]) -> None:
    for warning in warnings:
        print(f"tsterm: warning: {warning}", file=sys.stderr)


def _import_gguf(rest: list[str]) -> int:
    from tsterm.convert.gguf_cli import cli_main
    return cli_main(rest)


class HelpFormatter(argparse.HelpFormatter):
    """Every option's default in its help: a set default as argparse knows it, an option the profile fills in (None
    here) by its own help's "(default: ...)"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or "%(default)" in text or not action.option_strings \
                or action.default in (None, False, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("tsterm")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


PROFILE_HELP = "profile name or YAML path (default: %s)"
MODEL_HELP = ("an HF-format model directory, a shipped model (smollm2-135m-instruct, moe-demo, agent-demo) or "
              "demo:NAME (default: the profile's)")


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                        help="weights and activations (default: the profile's, else auto: bfloat16 on a GPU and on a "
                             "CPU with AMX-BF16 granted for a float model, float32 elsewhere)")
    parser.add_argument("--device", help="auto, cpu or cuda[:N] (default: the profile's, else auto: cuda when present)")


def _add_sampling_arguments(parser: argparse.ArgumentParser, full: bool = True) -> None:
    parser.add_argument("--max-tokens", type=int, dest="max_tokens", metavar="N",
                        help="most tokens of a reply (default: the profile's sampling.max_tokens, else 256)")
    parser.add_argument("--temperature", type=float, metavar="T",
                        help="0 is greedy (default: the profile's sampling.temperature, else 1.0)")
    if full:
        parser.add_argument("--top-p", type=float, dest="top_p", metavar="P",
                            help="nucleus sampling: keep the likeliest tokens up to this mass "
                                 "(default: the profile's, else 1.0: off)")
        parser.add_argument("--top-k", type=int, dest="top_k", metavar="K",
                            help="keep the K likeliest tokens (default: the profile's, else 0: off)")
    parser.add_argument("--seed", type=int, help="seed of the sampled tokens, for a repeatable reply "
                                                 "(default: none, a fresh draw each run)")


SPECULATIVE_FLAGS = ("speculative_method", "num_speculative_tokens")


def _add_speculative_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--speculative METHOD and --num-speculative-tokens K, exactly as `add_parallel_arguments` defines them for
    run, chat and serve (for the commands that take no parallel or quantization flags); llm_from_args passes them on
    over the profile's keys."""
    from tsterm.launch import add_parallel_arguments

    defined = argparse.ArgumentParser(add_help=False)
    add_parallel_arguments(defined)
    for action in defined._actions:
        if action.dest in SPECULATIVE_FLAGS:
            parser._add_action(action)
    return parser


def _add_agent(sub: Any) -> argparse.ArgumentParser:
    from tsterm.agent.headless import add_parser
    return _add_speculative_arguments(add_parser(sub))


def _add_bench(sub: Any) -> argparse.ArgumentParser:
    from tsterm.bench import add_parser  # torch, transformers' baselines: only for `tsterm bench`
    return _add_speculative_arguments(add_parser(sub))


def _add_serve(sub: Any) -> argparse.ArgumentParser:
    from tsterm.server.serve import add_parser
    return add_parser(sub)


def _add_plan(sub: Any) -> argparse.ArgumentParser:
    from tsterm.plan import add_parser
    return add_parser(sub)


# The subcommands other modules define, by name: (their one-line help, what adds their parser). A command line
# builds only the one it runs, so `tsterm --help`, `tsterm plan` and `tsterm profiles` never import what the others
# need (torch for `bench`). tests/test_cli.py checks each help here against its module's own.
ELSEWHERE: dict[str, tuple[str, Callable[[Any], argparse.ArgumentParser]]] = {
    "agent": ("run one agent task: the model calls tools until it answers", _add_agent),
    "bench": ("replay a multi-turn agent trace; report reuse, copies, roofline, speedup", _add_bench),
    "serve": ("serve the model over an OpenAI-compatible HTTP API", _add_serve),
    "plan": ("memory and decode-speed plan for a model on N GPUs, from config.json alone", _add_plan),
}


def build_parser(full: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The `tsterm` parser. `full`: which of the subcommands in ELSEWHERE get their whole parser (default: all);
    the others are there by name and help only (what `tsterm --help` lists), and parse nothing."""
    parser = argparse.ArgumentParser(prog="tsterm", description="A terminal workstation for local MoE language models.",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("--profile", help=PROFILE_HELP % "default")
    parser.add_argument("--auto", action="store_true", help="TUI agent sessions run write/command tools without asking")
    parser.add_argument("--workspace", help="the directory TUI agent sessions' tools work in (default: the profile's)")
    from tsterm.server.serve import add_workstation_serve_arguments
    add_workstation_serve_arguments(parser)
    from tsterm.chat.history import POLICIES
    from tsterm.launch import add_parallel_arguments
    from tsterm.profiles import DEFAULT_THINKING_HISTORY
    add_parallel_arguments(parser)
    sub = parser.add_subparsers(dest="command")

    run = sub.add_parser("run", help="one-shot generation, streamed to stdout", formatter_class=HelpFormatter)
    run.add_argument("--model", help=MODEL_HELP)
    run.add_argument("--profile", dest="profile", default=argparse.SUPPRESS,
                     help=PROFILE_HELP % "none; give --model or --profile")
    run.add_argument("--prompt", help="the user message (or raw text with --raw); - reads it from stdin "
                     "(default: stdin when it is a pipe)")
    run.add_argument("--system", help="system prompt (default: the profile's system_prompt)")
    run.add_argument("--raw", action="store_true", help="send the prompt as raw text, without the chat template")
    _add_sampling_arguments(run)
    _add_engine_arguments(run)
    run.add_argument("--json", action="store_true", help="print one JSON object (text, tokens, metrics) instead")
    add_parallel_arguments(run)
    run.set_defaults(func=cmd_run)

    chat = sub.add_parser("chat", help="multi-turn chat: the TUI on a terminal, line mode on a pipe or with --plain",
                          formatter_class=HelpFormatter)
    chat.add_argument("--model", help=MODEL_HELP)
    chat.add_argument("--profile", dest="profile", default=argparse.SUPPRESS,
                      help=PROFILE_HELP % "default, unless --model is given")
    chat.add_argument("--plain", action="store_true", help="line mode even on a terminal")
    chat.add_argument("--system", help="system prompt (default: the profile's system_prompt)")
    chat.add_argument("--thinking-history", choices=POLICIES, dest="thinking_history",
                      help="line mode: earlier turns in each prompt, preserve (the exact ids the engine computed, "
                           "reasoning included) or template (as the chat template renders them) (default: the "
                           f"profile's thinking_history, else {DEFAULT_THINKING_HISTORY})")
    _add_sampling_arguments(chat, full=False)
    _add_engine_arguments(chat)
    add_parallel_arguments(chat)
    chat.set_defaults(func=cmd_chat)

    info = sub.add_parser("info", help="this machine as an engine sees it: CPU, C builds, dtype auto, kernel choices",
                          formatter_class=HelpFormatter)
    info.add_argument("--model", help=MODEL_HELP)
    info.add_argument("--profile", dest="profile", default=argparse.SUPPRESS,
                      help=PROFILE_HELP % "default, unless --model is given")
    _add_engine_arguments(info)
    defined = argparse.ArgumentParser(add_help=False)
    add_parallel_arguments(defined)
    info._add_action(next(a for a in defined._actions if a.dest == "quantization"))
    info.add_argument("--measure", action="store_true",
                      help="measure the shape classes the kernel cache has no choice for (as an engine's start does)")
    info.add_argument("--json", action="store_true", help="print one JSON object instead")
    info.set_defaults(func=cmd_info)

    profiles = sub.add_parser("profiles", help="list, show or check YAML profiles")
    actions = profiles.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="every profile on the search path (./profiles, user config, shipped)")
    for action, help_text in (("show", "the resolved profile as YAML"), ("check", "validate only (loads no model)")):
        p = actions.add_parser(action, help=help_text)
        p.add_argument("profile_name", metavar="NAME|PATH")
    profiles.set_defaults(func=cmd_profiles)

    from tsterm.chat.sessions_cli import add_parser as add_sessions  # (the chat layer, loaded already; no torch)
    add_sessions(sub)

    for name, (help_text, add) in ELSEWHERE.items():  # in full where asked for, else by name and help only
        if full is None or name in full:
            add(sub)
        else:
            sub.add_parser(name, help=help_text, add_help=False)
    sub.choices["plan"].set_defaults(func=cmd_plan)

    gguf = sub.add_parser("import-gguf", help="convert a GGUF file into an HF-format model directory", add_help=False)
    gguf.set_defaults(func=lambda args: _import_gguf(args.rest))
    gguf.add_argument("rest", nargs=argparse.REMAINDER)
    for name, subparser in sub.choices.items():  # the other modules' subcommands show their defaults too
        if name != "import-gguf" and subparser.formatter_class is argparse.HelpFormatter:
            subparser.formatter_class = HelpFormatter
    return parser


def parse_args(argv: list[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """(the parser, the parsed command line), building in full only the subcommand `argv` runs: a first pass with
    every subcommand by name finds which one (an option it does not know is left for the second pass)."""
    command = build_parser(full=()).parse_known_args(argv)[0].command
    parser = build_parser(full=(command,) if command in ELSEWHERE else ())
    return parser, parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["import-gguf"]:  # its own parser (tsterm.convert.gguf_cli.cli_main) owns every option, --help too
        return _import_gguf(argv[1:])
    parser, args = parse_args(argv)
    if args.command is None:  # bare `tsterm` (or `tsterm --profile X`): the workstation
        from tsterm.server.serve import workstation_serve_overrides
        from tsterm.tui import main as tui
        try:
            serve = workstation_serve_overrides(args)
        except TstermError as e:
            parser.error(str(e))
        return tui(args.profile or "default", auto_approve=args.auto, workspace=args.workspace, serve=serve,
                   engine_options=_parallel_options(args))
    try:
        return args.func(args)
    except TstermError as e:
        print(f"tsterm: error: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:  # an unreadable file or directory: the user's to fix, not a bug worth a traceback
        print(f"tsterm: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
