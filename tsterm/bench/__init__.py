"""`tsterm bench`: an agent-trace replay against the engines users pick instead (transformers from scratch or with
its cache kept, llama.cpp), plus the zero-copy and roofline measurements.

Every figure is a ratio against a baseline measured in the same run on the same machine.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from tsterm.bench.fit import LONG_FACTOR, check_fit, fitting_micro_context
from tsterm.bench.measure import (
    batch_ceiling,
    bytes_read_per_token,
    copy_bandwidth,
    copy_bytes_per_token,
    decode_rate,
    parallel_ceiling,
    read_bandwidth,
    stored_decode_bytes,
)
from tsterm.bench.replay import ReplayResult, load_transformers, replay_transformers, replay_tsterm, warm_up
from tsterm.bench.report import format_table, write_plot
from tsterm.bench.trace import TraceSpec, agent_trace, load_agent_trace, make_trace, tool_seconds
from tsterm.errors import ConfigError, TstermError
from tsterm.launch import llm_from_args


RATE_SAMPLES = 3  # rounds of bandwidth / batch-1 / batch-P measurements
BASELINES = ("transformers", "transformers-cache", "llama.cpp")


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="replay a multi-turn agent trace; report reuse, copies, roofline, speedup")
    p.add_argument("--profile", dest="profile", default=argparse.SUPPRESS, help="profile (default: bench)")
    p.add_argument("--model", help="HF-format model directory (default: the profile's)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations (default: the profile's)")
    p.add_argument("--device", help="auto, cpu or cuda[:N] (default: the profile's)")
    p.add_argument("--sessions", type=int, default=1, help="parallel agent sessions (P)")
    p.add_argument("--trace", metavar="FILE", help="replay a recorded agent session (`tsterm agent --trace FILE`) "
                   "instead of the synthetic trace; --sessions copies of it run at once "
                   "(default: the synthetic trace)")
    p.add_argument("--turns", type=int, default=8, help="turns per session of the synthetic trace")
    p.add_argument("--system-tokens", type=int, default=TraceSpec.system_tokens,
                   help="shared system prompt + tool schemas (default: %(default)s)")
    p.add_argument("--task-tokens", type=int, default=64, help="the first turn's task, after the system prompt")
    p.add_argument("--turn-tokens", type=int, default=256, help="new tokens per later turn")
    p.add_argument("--output-tokens", type=int, default=32, help="fixed reply length")
    p.add_argument("--baseline", action="append", choices=[*BASELINES, "none"],
                   help="also replay the trace with: transformers (generate re-encodes the conversation each turn), "
                   "transformers-cache (generate keeps its cache across turns), llama.cpp (llama-cpp-python on the "
                   "model's GGUF file, its KV kept across turns; needs the bench extra); repeat the flag for several, "
                   "each reported as a ratio from the same run (default: none)")
    p.add_argument("--gguf", metavar="FILE", help="the GGUF file --baseline llama.cpp runs (default: the file the "
                   "model was imported from)")
    p.add_argument("--no-prefix-cache", action="store_true", help="also replay with the prefix cache off (ablation)")
    p.add_argument("--micro-context", type=int, help="short context of the copy and decode measurements; the copy "
                   "audit's long one is 8x (default: 256, or what the model's context and KV pool hold)")
    p.add_argument("--parallel", type=int, default=8, help="concurrent requests for the parallel decode measurement")
    p.add_argument("--json", dest="json_path", help="write every figure to this JSON file (default: none)")
    p.add_argument("--plot", help="draw TTFT per turn to this .svg (or .png with matplotlib installed) (default: none)")
    p.set_defaults(func=run_cli)
    return p


def _progress(message: str) -> None:
    sys.stderr.write(f"\r\033[K[bench] {message}" if sys.stderr.isatty() else f"[bench] {message}\n")
    sys.stderr.flush()


class BenchIncomplete(TstermError):
    """A failure (or ctrl+c) after something was measured: `results` holds what was, for the table and --json."""

    def __init__(self, results: dict, cause: BaseException):
        why = "interrupted" if isinstance(cause, KeyboardInterrupt) else f"{type(cause).__name__}: {cause}"
        super().__init__(f"the bench stopped after measuring {', '.join(results['measured']) or 'nothing'} ({why})")
        self.results = results


def run_cli(args: argparse.Namespace) -> int:
    if not getattr(args, "profile", None) and not args.model:
        args.profile = "bench"
    spec = TraceSpec(args.sessions, args.turns, args.system_tokens, args.task_tokens, args.turn_tokens,
                     args.output_tokens)
    if args.parallel < 1 or (args.micro_context is not None and args.micro_context < 2):
        raise ConfigError("--parallel must be >= 1 and --micro-context >= 2")
    recorded = load_agent_trace(args.trace) if args.trace else None  # a bad file fails before the model loads
    llm = llm_from_args(args)
    baselines = [b for b in dict.fromkeys(args.baseline or []) if b != "none"]
    try:
        results = run_bench(llm, spec, baseline=baselines, ablation=args.no_prefix_cache,
                            micro_context=args.micro_context, parallel=args.parallel, progress=_progress,
                            recorded=recorded, gguf=args.gguf)
    except BenchIncomplete as e:  # what was measured is printed and written before the error
        sys.stderr.write("\n")
        print(format_table(e.results))
        if args.json_path:
            Path(args.json_path).write_text(json.dumps(e.results, indent=2))
        raise
    sys.stderr.write("\n")
    print(format_table(results))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results, indent=2))
    if args.plot:
        write_plot(results, args.plot)
    return 0


def run_bench(llm, spec: TraceSpec, baseline: str | list[str] = "none", ablation: bool = False,
              micro_context: int | None = None, parallel: int = 8, progress=None, recorded: dict | None = None,
              gguf: str | None = None) -> dict:
    """`baseline`: one of BASELINES or a list of them, each replayed after tsterm. `recorded`: a loaded agent trace
    (tsterm.bench.trace.load_agent_trace) replayed instead of `spec`'s synthetic one, `spec.sessions` copies at once.
    `gguf`: llama.cpp's file (default: the one the model was imported from). `micro_context`: the short context of
    the copy and decode measurements (default: 256, or what the model's context and KV pool hold).
    A run that cannot fit is refused (ConfigError) before anything is measured; a failure after that raises
    BenchIncomplete with the figures measured so far."""
    baselines = [b for b in ([baseline] if isinstance(baseline, str) else baseline) if b != "none"]
    for name in baselines:
        if name not in BASELINES:
            raise ConfigError(f"unknown baseline {name!r} (choose from: {', '.join(BASELINES)})")
    engine = llm.engine
    cfg = engine.model_config
    if recorded is None:
        trace, described = make_trace(spec, cfg.vocab_size), dict(spec.__dict__)
    else:
        trace = agent_trace(recorded, cfg.vocab_size, sessions=spec.sessions, seed=spec.seed)
        described = {"recorded": True, "model": recorded.get("model"), "sessions": spec.sessions,
                     "steps": len(recorded["steps"]), "tool_seconds_not_replayed": tool_seconds(recorded)}
    if micro_context is None:
        micro_context = fitting_micro_context(engine.max_model_len, engine.kv.pool.num_blocks,
                                              engine.config.block_size, parallel)
        if micro_context < 2:
            raise ConfigError(f"the model's context ({engine.max_model_len} tokens) or KV pool is too small for the "
                              "copy and decode measurements: lower --parallel, or raise the profile's max_model_len "
                              "and kv_cache_memory")
    check_fit(engine, trace, micro_context, parallel, recorded is not None)
    llama = None
    if "llama.cpp" in baselines:  # a missing package or file fails before anything is measured
        from tsterm.bench.llama_cpp import context_needed, gguf_source, open_llama

        llama = open_llama(gguf or gguf_source(engine.config.model), context_needed(trace) + 16,
                           torch.get_num_threads())
    warm_up(engine)
    results: dict[str, Any] = {"model": engine.config.model, "dtype": str(engine.dtype).replace("torch.", ""),
                               "device": str(engine.device), "trace": described, "measured": [], "replays": {}}
    replays: dict[str, ReplayResult] = {}
    try:
        _measure(llm, trace, baselines, ablation, micro_context, parallel, progress, llama, replays, results)
    except (Exception, KeyboardInterrupt) as e:
        results["replays"] = {name: _replay_figures(r) for name, r in replays.items()}
        results["incomplete"] = str(e) or type(e).__name__
        raise BenchIncomplete(results, e) from e
    return results


def _replay_figures(r: ReplayResult) -> dict:
    return {"wall_s": r.wall_s, "ttft_by_turn_s": r.ttft_by_turn(), "decode_tokens_per_s": r.generated_tokens() / r.wall_s,
            "hit_rate_vs_theoretical": r.hit_rate_vs_theoretical(),
            "cached_tokens": sum(t.cached_tokens for t in r.turns),
            "state_copy_bytes": sum(t.state_copy_bytes for t in r.turns),
            "state_snapshot_bytes": sum(t.state_snapshot_bytes for t in r.turns),
            "turns": [t.__dict__ for t in r.turns]}


def _measure(llm, trace, baselines: list[str], ablation: bool, micro_context: int, parallel: int, progress, llama,
             replays: dict[str, ReplayResult], results: dict) -> None:
    """The replays, then the copy audit, bandwidth and decode rates, each recorded in `results` (and its name in
    results["measured"]) as soon as it is done."""
    engine = llm.engine
    cfg = engine.model_config
    replays["tsterm"] = replay_tsterm(engine, trace, "tsterm", progress)
    results["measured"].append("the tsterm replay")
    if ablation:
        engine.kv.pool.enable_prefix_caching = False
        try:
            replays["no_prefix_cache"] = replay_tsterm(engine, trace, "nocache", progress)
        finally:
            engine.kv.pool.enable_prefix_caching = True
        results["measured"].append("the replay without prefix cache")
    hf_model = None
    for name in baselines:
        if name == "llama.cpp":
            from tsterm.bench.llama_cpp import replay_llama_cpp

            replays[name] = replay_llama_cpp(llama, trace, progress)
        else:
            hf_model = hf_model or load_transformers(engine.config.model, engine.dtype)
            replays[name] = replay_transformers(hf_model, trace, progress, keep_cache=name == "transformers-cache")
        results["measured"].append(f"the {name} replay")
    del hf_model, llama
    results["replays"] = {name: _replay_figures(r) for name, r in replays.items()}
    ours = replays["tsterm"]
    ttft = ours.ttft_by_turn()
    speedup_vs = {name: replays[name].wall_s / ours.wall_s for name in baselines}
    results.update({
        # against the strongest baseline of the run (the smallest ratio); each one's is in speedup_vs
        "speedup_vs_baseline": min(speedup_vs.values()) if speedup_vs else None,
        "speedup_vs": speedup_vs,
        "ttft_last_over_turn2": ttft[-1] / ttft[1] if len(ttft) > 1 and ttft[1] else None,
        "hit_rate_vs_theoretical": ours.hit_rate_vs_theoretical(),
    })

    if progress:
        progress("measuring bandwidth, copies and decode rates")
    short = copy_bytes_per_token(engine, micro_context, salt=1)
    long = copy_bytes_per_token(engine, LONG_FACTOR * micro_context, salt=2)
    results["copy_audit"] = {"context_short": micro_context, "context_long": LONG_FACTOR * micro_context,
                             "short": short, "long": long}
    results["copy_bytes_per_token_long_over_short"] = (long["copy_bytes_per_token"] / short["copy_bytes_per_token"]
                                                       if short["copy_bytes_per_token"] else None)
    results["measured"].append("the copy audit")
    # Rates and the bandwidth they are compared with, sampled in rounds (the bandwidth of a shared machine drifts);
    # each rate reported is the best of its samples, and each ratio the median of its per-round ratios: a round's
    # samples are seconds apart, so a ratio compares figures of one bandwidth state (the 2-core machine switches
    # between ~35 and ~65 GB/s for minutes at a time: the best decode of a slow minute over the best bandwidth of a
    # fast one gave a roofline fraction of 0.47 in one run, when runs within either state gave 0.65-0.88).
    # The roofline is the read bandwidth: decode reads weights and KV and writes almost nothing. The copy bandwidth
    # (reads + writes counted) is reported next to it; on the shared 2-core machine it swung between 31 and 56 GB/s.
    samples: dict[str, list[float]] = {"read_bandwidth": [], "copy_bandwidth": [], "single": [], "batched": []}
    for _ in range(RATE_SAMPLES):
        samples["read_bandwidth"].append(read_bandwidth(engine.device))
        samples["copy_bandwidth"].append(copy_bandwidth(engine.device))
        samples["single"].append(decode_rate(engine, 1, micro_context, salt=3))
        samples["batched"].append(decode_rate(engine, parallel, micro_context, salt=4))
    bandwidth, copy_bw, single, batched = (max(samples[k]) for k in ("read_bandwidth", "copy_bandwidth", "single",
                                                                     "batched"))
    model = getattr(engine.executor, "model", None)  # one process: its weights as stored (quantized or not)
    stored = stored_decode_bytes(model, cfg, engine.dtype.itemsize, micro_context) if model is not None else None
    read_per_token = stored[0] if stored else bytes_read_per_token(cfg, engine.dtype.itemsize, micro_context)
    by_round = {"roofline_fraction": [t * read_per_token / b for t, b in zip(samples["single"], samples["read_bandwidth"])],
                "parallel_speedup": [b / t for b, t in zip(samples["batched"], samples["single"])]}
    roofline_fraction = statistics.median(by_round["roofline_fraction"])
    parallel_speedup = statistics.median(by_round["parallel_speedup"])
    memory_ceiling = parallel_ceiling(cfg, engine.dtype.itemsize, micro_context, parallel, stored)
    # the memory-bound ratio is a ceiling only for a batch-1 decode at its roofline: one that is not (a tiny model,
    # bound by its per-step overhead) leaves a batch more to gain (batch_ceiling)
    ceiling = batch_ceiling(memory_ceiling, parallel, roofline_fraction)
    results.update({
        "roofline_fraction": roofline_fraction,
        "parallel_speedup": parallel_speedup,
        "parallel_fraction_of_ceiling": parallel_speedup / ceiling,
        "decode": {"context": micro_context, "batch1_tokens_per_s": single, f"batch{parallel}_tokens_per_s": batched,
                   "parallel": parallel, "samples": samples, "ratios_by_round": by_round,
                   "memory_bound_ceiling": memory_ceiling, "parallel_ceiling": ceiling},
        "roofline": {"read_bandwidth_bytes_per_s": bandwidth, "copy_bandwidth_bytes_per_s": copy_bw,
                     "bytes_read_per_token": read_per_token,
                     "roofline_tokens_per_s": bandwidth / read_per_token,
                     "achieved_bandwidth_bytes_per_s": single * read_per_token},
        "engine_stats": engine.stats(),
    })
    results["measured"].append("the decode rates")
