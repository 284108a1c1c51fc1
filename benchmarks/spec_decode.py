"""Speculative decoding on a copy-heavy agent-like trace: decode tokens/s with suffix / ngram / off, in one run.

    python benchmarks/spec_decode.py [--profile default] [--methods off,ngram,suffix] [--k 8] [--max-tokens 256]
                                     [--rounds 3] [--profile-sampling]

The trace (on the profile's model and chat template; greedy without penalties, or `--profile-sampling`):
  rewrite   the agent has read a file (a tool result in the prompt) and writes it back whole with a small edit;
  quote     a tool's output quoted back after a short instruction;
  chat      a chat question whose answer does not repeat the prompt (though a small model greedy without a penalty
            loops: it repeats its own answer).
Each method has its own engine (same process, same model files); the methods run each trace in turn, `--rounds`
times (a fresh draft source each time: nothing learnt from an earlier round), and the median is shown. A request's
decode rate is its generated tokens after the first over the time from its first token to its last;
the table gives each trace's rate per method, its ratio to `off`, the drafted / accepted tokens, the tokens per
decode step (the speedup a verify step costing a decode step would give: it does not depend on the machine's load),
the mean accepted run per verify step, and whether each method's tokens equal `off`'s (they must: greedy is
lossless).
Prints the CPU model (lscpu) with the table.
"""
from __future__ import annotations

import argparse

from tsterm.bench.copy_trace import SOURCE_FILE
from tsterm.bench.machine import cpu_description

FILE = SOURCE_FILE.split("\n\n\n", 1)[1]  # the copy-heavy bench trace's file, without its module header

TOOL_OUTPUT = """$ pytest -q tests/test_config.py
..F.
=================================== FAILURES ===================================
__________________________ test_merge_keeps_base_keys __________________________
    def test_merge_keeps_base_keys():
        base = {"a": "1", "b": "2"}
        merged = merge_configs(base, {"b": "3"})
>       assert merged == {"a": "1", "b": "3", "c": "4"}
E       AssertionError: assert {'a': '1', 'b': '3'} == {'a': '1', 'b': '3', 'c': '4'}
tests/test_config.py:14: AssertionError
1 failed, 3 passed in 0.02s"""

TRACE = [
    ("rewrite", [
        {"role": "system", "content": "You are a coding agent. You edit files by writing them back whole."},
        {"role": "user", "content": "Read config.py."},
        {"role": "assistant", "content": "Here is config.py:\n\n```python\n" + FILE + "```"},
        {"role": "user", "content": "Rename parse_config to load_config everywhere and write the whole file "
                                    "again, unchanged otherwise, in one python code block."},
    ]),
    ("quote", [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Run the tests."},
        {"role": "assistant", "content": "Tool result:\n" + TOOL_OUTPUT},
        {"role": "user", "content": "Quote the failure section of the tool result exactly, then say in one "
                                    "sentence what is wrong."},
    ]),
    ("chat", [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Write a short poem about the sea."},
    ]),
]


def load(profile: str, method: str, k: int):
    from tsterm.launch import load_llm
    from tsterm.profiles import load_profile

    return load_llm(load_profile(profile), speculative_method=method, num_speculative_tokens=k)


def run_once(llm, method: str, k: int, prompt: list[int], max_tokens: int, profile_sampling: str | None) -> dict:
    """One reply to `prompt` (greedy without penalties, or the profile's sampling seeded), with a fresh draft source
    (nothing learnt from an earlier round's output)."""
    from tsterm import SamplingParams
    from tsterm.engine.spec_decode import make_draft_source
    from tsterm.profiles import load_profile

    if method != "off":
        llm.engine.drafter = make_draft_source(method, k)
    if profile_sampling:
        params = load_profile(profile_sampling).sampling_params(max_tokens=max_tokens, seed=0)
    else:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, frequency_penalty=0.0, presence_penalty=0.0,
                                repetition_penalty=1.0)
    before = llm.stats()
    out = llm.generate(prompt, params)[0]
    after = llm.stats()
    tokens, seconds = len(out.outputs[0].token_ids) - 1, out.metrics.e2e - out.metrics.ttft
    verifies = after["spec_num_drafts"] - before["spec_num_drafts"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    return dict(rate=tokens / seconds if seconds > 0 else 0.0, tokens=tokens,
                drafted=after["spec_draft_tokens"] - before["spec_draft_tokens"], accepted=accepted,
                mean_run=accepted / verifies if verifies else 0.0, ids=list(out.outputs[0].token_ids))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="default")
    parser.add_argument("--methods", default="off,ngram,suffix")
    parser.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3, help="runs of each trace per method (the median is shown)")
    parser.add_argument("--profile-sampling", action="store_true",
                        help="the profile's sampling (seeded) instead of greedy without penalties: a seeded reply is "
                             "the same with or without drafts")
    args = parser.parse_args()
    methods = args.methods.split(",")
    llms = {method: load(args.profile, method, args.k) for method in methods}
    results: dict[str, dict[str, dict]] = {method: {} for method in methods}
    warm = llms[methods[0]].tokenizer.apply_chat_template(TRACE[2][1], add_generation_prompt=True, tokenize=True)
    for method in methods:  # (threads, first-call costs)
        run_once(llms[method], method, args.k, warm, 8, None)
    for name, messages in TRACE:
        prompt = llms[methods[0]].tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        runs: dict[str, list[dict]] = {method: [] for method in methods}
        for _ in range(args.rounds):  # the methods interleaved, so a busy moment of the machine hits them alike
            for method in methods:
                runs[method].append(run_once(llms[method], method, args.k, prompt, args.max_tokens,
                                             args.profile if args.profile_sampling else None))
        for method in methods:
            rates = sorted(run["rate"] for run in runs[method])
            results[method][name] = dict(runs[method][0], rate=rates[len(rates) // 2])  # the median rate
    base = results.get("off")
    how = "the profile's sampling, seed 0" if args.profile_sampling else "greedy (no penalty)"
    print(f"\nprofile {args.profile}, {how}, K = {args.k}, max_tokens {args.max_tokens}, median of "
          f"{args.rounds} rounds; CPU: {cpu_description()}\n")
    print("| trace | method | decode tok/s | vs off | tokens | drafted | accepted | tokens / step | "
          "mean accepted / verify | same tokens as off |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for name, _ in TRACE:
        for method in methods:
            row = results[method][name]
            ratio = f"{row['rate'] / base[name]['rate']:.2f}x" if base and base[name]["rate"] else "-"
            # (seeded: the same tokens with or without drafts, sampled or greedy)
            same = "-" if not base else ("yes" if row["ids"] == base[name]["ids"] else "NO")
            per_step = row["tokens"] / max(row["tokens"] - row["accepted"], 1)  # (each decode step: 1 + accepted)
            print(f"| {name} | {method} | {row['rate']:.1f} | {ratio} | {row['tokens']} | {row['drafted']} | "
                  f"{row['accepted']} | {per_step:.2f} | {row['mean_run']:.2f} | {same} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
