"""`tsterm bench`: an agent-trace replay against the engines users pick instead (transformers from scratch or with
its cache kept, llama.cpp, and each with prompt-lookup drafts), plus the zero-copy and roofline measurements. With
speculative decoding on (`--speculative METHOD`), tsterm replays the trace with and without its drafts.

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
from tsterm.bench.replay import (
    ReplayResult,
    drafting,
    first_divergence,
    load_transformers,
    replay_transformers,
    replay_transformers_lookup,
    replay_tsterm,
    warm_up,
)
from tsterm.bench.report import format_table, write_plot
from tsterm.bench.trace import TraceSpec, agent_trace, load_agent_trace, make_trace, tool_seconds
from tsterm.bench import copy_trace
from tsterm.errors import ConfigError, TstermError
from tsterm.launch import llm_from_args


RATE_SAMPLES = 3  # rounds of bandwidth / batch-1 / batch-P measurements
BASELINES = ("transformers", "transformers-cache", "llama.cpp", "llama.cpp-lookup", "transformers-lookup")
NO_SPEC = "tsterm-no-spec"  # the replay with the engine's drafts switched off, when it speculates


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="replay a multi-turn agent trace; report reuse, copies, roofline, speedup")
    p.add_argument("--profile", dest="profile", default=argparse.SUPPRESS, help="profile (default: bench)")
    p.add_argument("--model", help="HF-format model directory (default: the profile's)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations (default: the profile's)")
    p.add_argument("--device", help="auto, cpu or cuda[:N] (default: the profile's)")
    p.add_argument("--sessions", type=int, default=1, help="parallel agent sessions (P)")
    p.add_argument("--trace", metavar="FILE|copy-heavy", help="replay a recorded agent session (`tsterm agent "
                   "--trace FILE`) instead of the synthetic trace, or copy-heavy: an agent that reads a file, writes "
                   "it back whole with small edits and quotes tool output back, in the model's own tokens and chat "
                   "template (a recorded file of that name: ./copy-heavy); --sessions copies of it run at once "
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
                   "model's GGUF file, its KV kept across turns; needs the bench extra), llama.cpp-lookup (the same "
                   "with llama-cpp-python's prompt-lookup draft), transformers-lookup (prompt lookup, "
                   "prompt_lookup_num_tokens, its cache kept across turns); the lookups draft up to "
                   "--num-speculative-tokens; repeat the flag for several, each reported as a ratio from the same "
                   "run (default: none)")
    p.add_argument("--gguf", metavar="FILE", help="the GGUF file --baseline llama.cpp[-lookup] runs (default: the "
                   "file the model was imported from)")
    p.add_argument("--rounds", type=int, default=1, help="replays of the trace by every engine, interleaved round by "
                   "round (a busy moment of a shared machine hits them alike); each ratio is the median of its "
                   "rounds'")
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
    if args.rounds < 1:
        raise ConfigError(f"--rounds must be >= 1, got {args.rounds}")
    copy_heavy = args.trace == copy_trace.NAME
    # a bad file fails before the model loads
    recorded = load_agent_trace(args.trace) if args.trace and not copy_heavy else None
    llm = llm_from_args(args)
    baselines = [b for b in dict.fromkeys(args.baseline or []) if b != "none"]
    try:
        results = run_bench(llm, spec, baseline=baselines, ablation=args.no_prefix_cache,
                            micro_context=args.micro_context, parallel=args.parallel, progress=_progress,
                            recorded=recorded, gguf=args.gguf, copy_heavy=copy_heavy, rounds=args.rounds)
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
              gguf: str | None = None, copy_heavy: bool = False, rounds: int = 1) -> dict:
    """`baseline`: one of BASELINES or a list of them, each replayed after tsterm. `recorded`: a loaded agent trace
    (tsterm.bench.trace.load_agent_trace) replayed instead of `spec`'s synthetic one, `spec.sessions` copies at once;
    `copy_heavy`: the copy-heavy agent trace (tsterm.bench.copy_trace) instead, `spec.sessions` sessions.
    `gguf`: llama.cpp's file (default: the one the model was imported from). `micro_context`: the short context of
    the copy and decode measurements (default: 256, or what the model's context and KV pool hold). `rounds`: replays
    of every engine, interleaved; each replay reported is its median round (by wall time), each ratio the median of
    the rounds' ratios. An engine built with speculative decoding also replays with its drafts off (NO_SPEC).
    A run that cannot fit is refused (ConfigError) before anything is measured; a failure after that raises
    BenchIncomplete with the figures measured so far."""
    baselines = [b for b in ([baseline] if isinstance(baseline, str) else baseline) if b != "none"]
    for name in baselines:
        if name not in BASELINES:
            raise ConfigError(f"unknown baseline {name!r} (choose from: {', '.join(BASELINES)})")
    engine = llm.engine
    cfg = engine.model_config
    if copy_heavy:
        trace, _ = copy_trace.copy_heavy_trace(llm.tokenizer, spec.sessions)
        described = {"name": copy_trace.NAME, "sessions": spec.sessions,
                     "new_tokens_by_turn": [len(t.new_ids) for t in trace[0]],
                     "output_tokens_by_turn": [t.output_tokens for t in trace[0]]}
    elif recorded is None:
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
    if rounds < 1:
        raise ConfigError(f"--rounds must be >= 1, got {rounds}")
    llamas: dict[str, Any] = {}
    for name in ("llama.cpp", "llama.cpp-lookup"):
        if name in baselines:  # a missing package or file fails before anything is measured
            from tsterm.bench.llama_cpp import context_needed, gguf_source, open_llama

            lookup = engine.config.num_speculative_tokens if name == "llama.cpp-lookup" else None
            llamas[name] = open_llama(gguf or gguf_source(engine.config.model), context_needed(trace) + 16,
                                      torch.get_num_threads(), lookup_tokens=lookup)
    warm_up(engine)
    results: dict[str, Any] = {"model": engine.config.model, "dtype": str(engine.dtype).replace("torch.", ""),
                               "device": str(engine.device), "trace": described, "rounds": rounds, "measured": [],
                               "replays": {}}
    replays: dict[str, ReplayResult] = {}
    try:
        _measure(llm, trace, baselines, ablation, micro_context, parallel, progress, llamas, replays, results,
                 rounds)
    except (Exception, KeyboardInterrupt) as e:
        results["replays"] = {name: _replay_figures(r) for name, r in replays.items()}
        results["incomplete"] = str(e) or type(e).__name__
        raise BenchIncomplete(results, e) from e
    return results


def _replay_figures(r: ReplayResult) -> dict:
    return {"wall_s": r.wall_s, "ttft_by_turn_s": r.ttft_by_turn(), "decode_tokens_per_s": r.generated_tokens() / r.wall_s,
            "decode_only_tokens_per_s": r.decode_tokens_per_s(),
            "hit_rate_vs_theoretical": r.hit_rate_vs_theoretical(),
            "cached_tokens": sum(t.cached_tokens for t in r.turns),
            "state_copy_bytes": sum(t.state_copy_bytes for t in r.turns),
            "state_snapshot_bytes": sum(t.state_snapshot_bytes for t in r.turns),
            "phases": dict(r.phases), "turns": [t.__dict__ for t in r.turns]}


def _stat_delta(before: Any, after: Any) -> Any:
    """An engine counter's growth: a number, or a list / dict of them (per-position counters) element by element."""
    if isinstance(after, dict):
        return {key: value - (before or {}).get(key, 0) for key, value in after.items()}
    if isinstance(after, (list, tuple)):
        before = list(before or [])
        return [value - (before[i] if i < len(before) else 0) for i, value in enumerate(after)]
    return after - (before or 0)


def _replay_tsterm_speculating(engine, trace, name: str, progress, on: bool, spec: dict) -> ReplayResult:
    """One replay with the engine's drafts on (a fresh draft source; its verifies counted into `spec`) or off."""
    before = engine.stats()
    with drafting(engine, on) as recorded:
        result = replay_tsterm(engine, trace, name, progress, cache_salt=name)
    if on:
        after = engine.stats()
        for key in ("spec_num_drafts", "spec_draft_tokens", "spec_accepted_tokens", "spec_drafted_per_pos",
                    "spec_accepted_per_pos"):
            if key in after:
                spec[key] = _sum(spec.get(key), _stat_delta(before.get(key), after[key]))
        spec["recorded_drafted_by_position"] = _sum(spec.get("recorded_drafted_by_position"), recorded.drafted)
        spec["recorded_accepted_by_position"] = _sum(spec.get("recorded_accepted_by_position"), recorded.accepted)
    else:  # (none: the check that the replay without drafts ran without them)
        spec["no_spec_draft_tokens"] = _sum(spec.get("no_spec_draft_tokens"), engine.stats()["spec_draft_tokens"]
                                            - before["spec_draft_tokens"])
    return result


def _sum(a: Any, b: Any) -> Any:
    """Counters added up over rounds (numbers, or lists / dicts of them)."""
    if a is None:
        return b
    if isinstance(b, dict):
        return {key: a.get(key, 0) + b.get(key, 0) for key in {*a, *b}}
    if isinstance(b, list):
        return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(max(len(a), len(b)))]
    return a + b


def _speculation_figures(spec: dict, runs: dict[str, list[ReplayResult]], engine) -> dict:
    """Drafted / accepted counts, mean accepted length (accepted drafts per verify), acceptance at each draft
    position (of the verifies that drafted a k-th token, the share that accepted it), and the decode and end-to-end
    ratios of the replay with drafts over the one without."""
    config = engine.config
    verifies = spec.get("spec_num_drafts", 0)
    # by position: the engine's own counters (Engine.stats' spec_*_per_pos), else what the bench's wrapper of the
    # draft source counted (recorded_*, kept next to them: the two must agree)
    from_engine = "spec_drafted_per_pos" in spec
    drafted = spec["spec_drafted_per_pos" if from_engine else "recorded_drafted_by_position"]
    accepted = spec["spec_accepted_per_pos" if from_engine else "recorded_accepted_by_position"]
    figures = {
        "method": config.speculative_method, "num_speculative_tokens": config.num_speculative_tokens,
        "num_drafts": verifies, "draft_tokens": spec.get("spec_draft_tokens", 0),
        "accepted_tokens": spec.get("spec_accepted_tokens", 0),
        "mean_accepted_length": spec.get("spec_accepted_tokens", 0) / verifies if verifies else 0.0,
        "acceptance_rate": spec.get("spec_accepted_tokens", 0) / spec["spec_draft_tokens"]
        if spec.get("spec_draft_tokens") else 0.0,
        "drafted_by_position": drafted, "accepted_by_position": accepted,
        "by_position_from": "engine" if from_engine else "bench",
        "recorded_drafted_by_position": spec["recorded_drafted_by_position"],
        "recorded_accepted_by_position": spec["recorded_accepted_by_position"],
        "acceptance_by_position": [a / d if d else None for a, d in zip(accepted, drafted)],
        "no_spec_draft_tokens": spec.get("no_spec_draft_tokens", 0),
        "decode_speedup_vs_off": statistics.median([on.decode_tokens_per_s() / off.decode_tokens_per_s()
                                          for on, off in zip(runs["tsterm"], runs[NO_SPEC])]),
        "e2e_speedup_vs_off": statistics.median([off.wall_s / on.wall_s for on, off in zip(runs["tsterm"], runs[NO_SPEC])]),
    }
    return figures


def _measure(llm, trace, baselines: list[str], ablation: bool, micro_context: int, parallel: int, progress,
             llamas: dict[str, Any], replays: dict[str, ReplayResult], results: dict, rounds: int = 1) -> None:
    """The replays (`rounds` of them, every engine in turn in each), then the copy audit, bandwidth and decode rates,
    each recorded in `results` (and its name in results["measured"]) as soon as it is done."""
    engine = llm.engine
    cfg = engine.model_config
    speculating = engine.drafter is not None
    runs: dict[str, list[ReplayResult]] = {}
    spec: dict[str, Any] = {}

    def keep(name: str, result: ReplayResult, what: str) -> None:
        runs.setdefault(name, []).append(result)
        replays[name] = result
        results["measured"].append(what + (f" (round {len(runs[name])})" if rounds > 1 else ""))

    hf_model = None
    for round_ in range(rounds):
        tag = f"@{round_}" if rounds > 1 else ""
        if speculating:
            keep("tsterm", _replay_tsterm_speculating(engine, trace, f"tsterm{tag}", progress, True, spec),
                 "the tsterm replay")
            keep(NO_SPEC, _replay_tsterm_speculating(engine, trace, f"{NO_SPEC}{tag}", progress, False, spec),
                 "the tsterm replay without speculation")
        else:
            keep("tsterm", replay_tsterm(engine, trace, f"tsterm{tag}", progress, cache_salt=f"tsterm{tag}"),
                 "the tsterm replay")
        if ablation and round_ == 0:
            engine.kv.pool.enable_prefix_caching = False
            try:
                keep("no_prefix_cache", replay_tsterm(engine, trace, "nocache", progress),
                     "the replay without prefix cache")
            finally:
                engine.kv.pool.enable_prefix_caching = True
        for name in baselines:
            if name in llamas:
                from tsterm.bench.llama_cpp import replay_llama_cpp

                llamas[name].reset()  # nothing held from an earlier round's conversation
                result = replay_llama_cpp(llamas[name], trace, progress, name=name)
            else:
                hf_model = hf_model or load_transformers(engine.config.model, engine.dtype)
                if name == "transformers-lookup":
                    result = replay_transformers_lookup(hf_model, trace, engine.config.num_speculative_tokens,
                                                        progress)
                else:
                    result = replay_transformers(hf_model, trace, progress, keep_cache=name == "transformers-cache")
            keep(name, result, f"the {name} replay")
    del hf_model
    llamas.clear()
    for name, results_ in runs.items():  # each replay reported: its median round by wall time
        replays[name] = sorted(results_, key=lambda r: r.wall_s)[(len(results_) - 1) // 2]
    results["replays"] = {name: dict(_replay_figures(r), rounds_wall_s=[x.wall_s for x in runs[name]],
                                     rounds_decode_only_tokens_per_s=[x.decode_tokens_per_s() for x in runs[name]])
                          for name, r in replays.items()}
    ours = replays["tsterm"]
    ttft = ours.ttft_by_turn()
    compared = [*baselines, *([NO_SPEC] if speculating else [])]
    speedup_vs = {name: statistics.median([theirs.wall_s / mine.wall_s for mine, theirs in zip(runs["tsterm"], runs[name])])
                  for name in baselines}
    results.update({
        # against the strongest baseline of the run (the smallest ratio); each one's is in speedup_vs
        "speedup_vs_baseline": min(speedup_vs.values()) if speedup_vs else None,
        "speedup_vs": speedup_vs,
        # by process CPU seconds (what each replay computed, whatever the other processes of a shared machine took
        # of the cores meanwhile), tsterm's over each baseline's that measures it
        "cpu_speedup_vs": {name: statistics.median([theirs.phases["cpu_s"] / mine.phases["cpu_s"]
                                                    for mine, theirs in zip(runs["tsterm"], runs[name])])
                           for name in baselines
                           if all(r.phases.get("cpu_s") for r in (*runs["tsterm"], *runs[name]))},
        # decode only (each turn's tokens after its first over their time), tsterm's over each other replay's
        "decode_speedup_vs": {name: statistics.median([mine.decode_tokens_per_s() / theirs.decode_tokens_per_s()
                                             for mine, theirs in zip(runs["tsterm"], runs[name])
                                             if theirs.decode_tokens_per_s()] or [0.0])
                              for name in compared},
        # greedy tokens of each other replay against tsterm's (first round): None, or where they first differ
        "divergence_from_tsterm": {name: first_divergence(runs["tsterm"][0], runs[name][0])
                                   for name in [*compared, *(["no_prefix_cache"] if ablation else [])]},
        "ttft_last_over_turn2": ttft[-1] / ttft[1] if len(ttft) > 1 and ttft[1] else None,
        "hit_rate_vs_theoretical": ours.hit_rate_vs_theoretical(),
    })
    if speculating:
        results["speculation"] = _speculation_figures(spec, runs, engine)

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
