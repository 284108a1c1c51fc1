"""The default profile's sampling, measured on both sides of the trade (issue 19, item 1).

    OMP_NUM_THREADS=1 python benchmarks/default_sampling.py [--profile default] [--configs rep1.0,...] [--dump F]

(On a busy 2-core machine one thread per process is several times faster than torch's default.)

For each candidate (a set of penalties), on the profile's model and chat template (system prompt included):
  loops    16 sampled replies (4 chat prompts x 4 seeds, the profile's temperature/top_p/max_tokens) that loop:
           a run of 10 tokens occurs 3 times in the reply;
  greedy   short factual questions with known answers (20) answered right at temperature 0 (the README's command);
  sampled  the same questions at the profile's temperature/top_p, 2 seeds each (40 answers; --answer-seeds).
An answer is right when its first sentence holds an accepted answer as a whole word (case-insensitive); `--dump`
writes every answer, to read them too. Prints one table row per candidate (markdown).
"""
from __future__ import annotations

import argparse
import re
import sys
import time

CHAT_PROMPTS = [
    "Write a short poem about the sea.",
    "Tell me a story about a dragon.",
    "Explain how photosynthesis works.",
    "What are the benefits of regular exercise?",
]

QUESTIONS: list[tuple[str, tuple[str, ...]]] = [
    ("What is the capital of France?", ("Paris",)),
    ("What is the capital of Japan?", ("Tokyo",)),
    ("What is the capital of Italy?", ("Rome",)),
    ("What is the capital of Germany?", ("Berlin",)),
    ("What is the capital of Spain?", ("Madrid",)),
    ("What is the capital of Canada?", ("Ottawa",)),
    ("What is 2 + 2?", ("4", "four")),
    ("What is 7 times 8?", ("56", "fifty-six")),
    ("What is 10 minus 3?", ("7", "seven")),
    ("What is 100 divided by 4?", ("25", "twenty-five")),
    ("How many days are in a week?", ("7", "seven")),
    ("How many legs does a spider have?", ("8", "eight")),
    ("What color is the sky on a clear day?", ("blue",)),
    ("What is the chemical formula of water?", ("H2O", "H₂O")),
    ("Who wrote Romeo and Juliet?", ("Shakespeare",)),
    ("Which planet is known as the Red Planet?", ("Mars",)),
    ("What is the largest ocean on Earth?", ("Pacific",)),
    ("At what temperature in degrees Celsius does water freeze?", ("0", "zero")),
    ("How many continents are there?", ("7", "seven")),
    ("What gas do plants take in from the air for photosynthesis?", ("carbon dioxide", "CO2", "CO₂")),
]

# name -> penalties (the rest of the sampling is the profile's)
CANDIDATES: dict[str, dict[str, float]] = {  # presence/frequency count output tokens only, not the question
    "rep1.0": {"repetition_penalty": 1.0},
    "rep1.1": {"repetition_penalty": 1.1},
    "rep1.2": {"repetition_penalty": 1.2},
    "freq0.5": {"repetition_penalty": 1.0, "frequency_penalty": 0.5},
    "freq1.0": {"repetition_penalty": 1.0, "frequency_penalty": 1.0},
    "pres1.0": {"repetition_penalty": 1.0, "presence_penalty": 1.0},
    "pres1.0+freq0.5": {"repetition_penalty": 1.0, "presence_penalty": 1.0, "frequency_penalty": 0.5},
}

LOOP_RUN, LOOP_TIMES = 10, 3
SEEDS = range(4)  # 4 chat prompts x 4 seeds = 16 replies


def loops(token_ids: list[int]) -> bool:
    """A run of LOOP_RUN tokens occurring LOOP_TIMES times (overlaps count: one token repeated is a loop too)."""
    seen: dict[tuple[int, ...], int] = {}
    for i in range(len(token_ids) - LOOP_RUN + 1):
        run = tuple(token_ids[i:i + LOOP_RUN])
        seen[run] = seen.get(run, 0) + 1
        if seen[run] >= LOOP_TIMES:
            return True
    return False


def first_sentence(text: str) -> str:
    return re.split(r"(?<=[.!?])\s|\n", text.strip(), maxsplit=1)[0]


def right(text: str, accepted: tuple[str, ...]) -> bool:
    sentence = first_sentence(text)
    return any(re.search(rf"(?<!\w){re.escape(a)}(?!\w)", sentence, re.IGNORECASE) for a in accepted)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="default")
    parser.add_argument("--configs", default=",".join(CANDIDATES), help="comma-separated candidate names")
    parser.add_argument("--answer-tokens", type=int, default=48, help="max_tokens of a factual answer")
    parser.add_argument("--answer-seeds", type=int, default=2, help="seeds per question for the sampled answers")
    parser.add_argument("--no-replies", action="store_true", help="skip the 16 chat replies (the loop count)")
    parser.add_argument("--dump", help="write every reply and answer to this file")
    args = parser.parse_args()

    from tsterm.config import SamplingParams
    from tsterm.launch import load_llm
    from tsterm.profiles import load_profile

    profile = load_profile(args.profile)
    llm = load_llm(profile)
    base = {k: v for k, v in profile.sampling.items()
            if k not in ("repetition_penalty", "presence_penalty", "frequency_penalty")}

    def chat_ids(text: str) -> list[int]:
        messages = [{"role": "system", "content": profile.system_prompt}] if profile.system_prompt else []
        messages.append({"role": "user", "content": text})
        return llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)

    def run(prompts: list[list[int]], params: list[SamplingParams], chunk: int = 16):
        outs = []
        for i in range(0, len(prompts), chunk):  # a chunk's KV fits the profile's budget
            outs += llm.generate(prompts[i:i + chunk], params[i:i + chunk])
        return outs

    chat = [chat_ids(p) for p in CHAT_PROMPTS]
    questions = [chat_ids(q) for q, _ in QUESTIONS]
    dump = open(args.dump, "w") if args.dump else None
    print(f"profile {profile.name}: {profile.engine['model']}, sampling {base}; loop = a {LOOP_RUN}-token run "
          f"{LOOP_TIMES} times; an answer is right when its first sentence holds the known answer")
    print()
    print("| candidate | looping sampled replies (of 16) | mean reply tokens | greedy right (of 20) "
          "| sampled right | seconds |")
    print("|---|---|---|---|---|---|")
    for name in args.configs.split(","):
        penalties = CANDIDATES[name]
        started = time.perf_counter()
        sampled = {**base, **penalties}
        greedy = {**sampled, "temperature": 0.0, "max_tokens": args.answer_tokens}
        answer = {**sampled, "max_tokens": args.answer_tokens}
        print(f"[{name}] 16 chat replies", file=sys.stderr, flush=True)
        replies = [] if args.no_replies else run([ids for ids in chat for _ in SEEDS],
                                                 [SamplingParams(**sampled, seed=s) for _ in chat for s in SEEDS])
        looping = sum(loops(list(o.token_ids)) for o in replies) if replies else "-"
        mean_tokens = sum(len(o.token_ids) for o in replies) / len(replies) if replies else float("nan")
        print(f"[{name}] greedy and sampled answers", file=sys.stderr, flush=True)
        greedy_outs = run(questions, [SamplingParams(**greedy)] * len(questions), chunk=20)
        greedy_right = sum(right(o.text, acc) for o, (_, acc) in zip(greedy_outs, QUESTIONS))
        seeds = range(args.answer_seeds)
        sampled_outs = run([ids for ids in questions for _ in seeds],
                           [SamplingParams(**answer, seed=s) for _ in questions for s in seeds], chunk=40)
        sampled_right = sum(right(o.text, QUESTIONS[i // len(seeds)][1]) for i, o in enumerate(sampled_outs))
        seconds = time.perf_counter() - started
        print(f"| {name} | {looping} | {mean_tokens:.0f} | {greedy_right} | {sampled_right} of {len(sampled_outs)} "
              f"| {seconds:.0f} |",
              flush=True)
        if dump:
            dump.write(f"=== {name} {penalties}\n")
            for i, o in enumerate(replies):
                dump.write(f"--- reply {CHAT_PROMPTS[i // len(SEEDS)]!r} seed {i % len(SEEDS)} "
                           f"loops={loops(list(o.token_ids))}\n{o.text}\n")
            for o, (q, acc) in zip(greedy_outs, QUESTIONS):
                dump.write(f"--- greedy {q!r} right={right(o.text, acc)}\n{o.text}\n")
            for i, o in enumerate(sampled_outs):
                q, acc = QUESTIONS[i // len(seeds)]
                dump.write(f"--- sampled {q!r} seed {i % len(seeds)} right={right(o.text, acc)}\n{o.text}\n")
            dump.flush()


if __name__ == "__main__":
    main()
