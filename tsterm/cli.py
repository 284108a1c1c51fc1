"""`tsterm` command line. Exit codes: 0 ok, 1 runtime error, 2 usage/config error."""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from tsterm.errors import ConfigError, TstermError


def _progress_printer(label: str):
    """Load progress on stderr (stdout carries only the answer)."""
    last = [0.0]
    tty = sys.stderr.isatty()

    def progress(done: int, total: int, what: str) -> None:
        now = time.monotonic()
        if tty and (now - last[0] > 0.1 or done >= total):
            last[0] = now
            pct = 100.0 * done / max(total, 1)
            sys.stderr.write(f"\r{label} {pct:5.1f}% ({done / 1e6:.1f}/{total / 1e6:.1f} MB)")
            if done >= total:
                sys.stderr.write("\n")
            sys.stderr.flush()

    return progress


def _engine_options(args: argparse.Namespace) -> tuple[str, dict[str, Any], Any]:
    """(model dir, engine options, profile or None) from --model/--profile and overrides."""
    from tsterm.profiles import Profile, load_profile, resolve_model

    profile: Profile | None = None
    options: dict[str, Any] = {}
    if args.profile:
        profile = load_profile(args.profile)
        config = profile.engine_config()
        model = config.model
        options = {k: v for k, v in profile.engine.items() if k != "model"}
    if args.model:
        model = resolve_model(args.model)
    elif not args.profile:
        raise ConfigError("give --model DIR or --profile NAME")
    for key in ("dtype", "device"):
        if getattr(args, key):
            options[key] = getattr(args, key)
    return model, options, profile


def engine_from_args(args: argparse.Namespace):
    """An LLM for --model/--profile (+ --dtype/--device), showing load progress on stderr."""
    from tsterm.llm import LLM

    model, options, _ = _engine_options(args)
    return LLM(model, progress=_progress_printer("loading"), **options)


def cmd_run(args: argparse.Namespace) -> int:
    from tsterm.config import SamplingParams
    from tsterm.llm import LLM

    model, options, profile = _engine_options(args)
    # Validate the sampling options before the (possibly long) model load.
    sampling = dict(profile.sampling) if profile else {}
    for key in ("temperature", "max_tokens", "top_p", "top_k", "seed"):
        if getattr(args, key) is not None:
            sampling[key] = getattr(args, key)
    params = SamplingParams(**sampling)
    llm = LLM(model, progress=_progress_printer("loading"), **options)
    if args.raw:
        prompt: Any = args.prompt
    else:
        messages = []
        system = args.system if args.system is not None else (profile.system_prompt if profile else None)
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
        m = out.metrics
        json.dump({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                   "prompt_tokens": len(out.prompt_token_ids), "cached_tokens": out.num_cached_tokens,
                   "ttft_s": m.ttft, "e2e_s": m.e2e, "mean_itl_s": m.mean_itl}, sys.stdout)
    sys.stdout.write("\n")
    return 0


def _import_gguf(rest: list[str]) -> int:
    from tsterm.gguf_import import cli_main
    return cli_main(rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tsterm", description="A terminal workstation for local MoE language models.")
    parser.add_argument("--profile", help="profile name or YAML path (default: default)")
    sub = parser.add_subparsers(dest="command")

    run = sub.add_parser("run", help="one-shot generation, streamed to stdout")
    run.add_argument("--model", help="HF-format model directory (or demo:tiny)")
    run.add_argument("--profile", dest="profile", default=argparse.SUPPRESS, help="profile name or YAML path")
    run.add_argument("--prompt", required=True, help="the user message (or raw text with --raw)")
    run.add_argument("--system", help="system prompt")
    run.add_argument("--raw", action="store_true", help="send the prompt as raw text, without the chat template")
    run.add_argument("--max-tokens", type=int, dest="max_tokens")
    run.add_argument("--temperature", type=float)
    run.add_argument("--top-p", type=float, dest="top_p")
    run.add_argument("--top-k", type=int, dest="top_k")
    run.add_argument("--seed", type=int)
    run.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    run.add_argument("--device", help="auto, cpu or cuda[:N]")
    run.add_argument("--json", action="store_true", help="print one JSON object (text, tokens, metrics) instead")
    run.set_defaults(func=cmd_run)

    from tsterm.bench import add_parser as add_bench_parser
    add_bench_parser(sub)

    gguf = sub.add_parser("import-gguf", help="convert a GGUF file into an HF-format model directory", add_help=False)
    gguf.set_defaults(func=lambda args: _import_gguf(args.rest))
    gguf.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["import-gguf"]:  # its own parser (tsterm.gguf_import.cli_main) owns every option, --help too
        return _import_gguf(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # bare `tsterm` (or `tsterm --profile X`): the workstation
        from tsterm.tui import main as tui
        return tui(args.profile or "default")
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
