"""What the structured-output mask costs per token, against a default-model decode step (issue 32, item 1).

    OMP_NUM_THREADS=1 python benchmarks/structured_output.py [--profile default] [--tokens 64] [--batch 1,8]
        [--compare-xgrammar]

In one run, on the profile's model:
  step     the engine's decode step, free (every row unconstrained) and constrained (every row under the schema
           below), median over the decode steps of `--tokens` tokens per row, batch 1 and the other `--batch` sizes;
  mask     the constrained reply's tokens replayed through a fresh grammar: per token, llguidance's bitmask fill for
           the batch's rows (`GrammarCompiler.fill_bitmask`), its application to a [B, V] logits batch
           (`apply_bitmask`) and the matchers' advance (`Grammar.accept`), each timed alone (mean, median, p90, max);
  ratio    the mask's mean per step over the free decode step's median: the issue's target is <= 10%.
`--compare-xgrammar`: the same fill on xgrammar, if it is importable (it is no dependency: it needs transformers
for its tokenizer info), for the choice of library (tsterm/engine/structured.py).
The schema: a pydantic model of six fields (a string, an integer, an enum, an array of strings, a nested object of
three strings, an optional string), the chat prompt asks for it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from importlib.metadata import version
from enum import Enum


def _schema() -> dict:
    import pydantic

    class Colour(str, Enum):
        red = "red"
        green = "green"
        blue = "blue"

    class Address(pydantic.BaseModel):
        street: str
        city: str
        postcode: str

    class Person(pydantic.BaseModel):
        name: str
        age: int
        favourite_colour: Colour
        hobbies: list[str] = pydantic.Field(max_length=4)
        address: Address
        email: str | None = None

    return Person.model_json_schema()


def _summary(seconds: list[float]) -> dict[str, float]:
    us = sorted(s * 1e6 for s in seconds)
    return {"mean": statistics.fmean(us), "median": statistics.median(us), "p90": us[int(0.9 * (len(us) - 1))],
            "max": us[-1]}


def _decode_steps(llm, prompts: list[list[int]], params) -> tuple[list[float], list]:
    """Seconds of each engine step after the prompts' (all rows decoding), and the outputs."""
    engine = llm.engine
    for prompt in prompts:
        engine.add_request(prompt, params)
    steps, outputs, prefilled = [], {}, False
    while engine.has_unfinished():
        started = time.perf_counter()
        outs = engine.step()
        elapsed = time.perf_counter() - started
        if prefilled and len(engine.scheduler.running) == len(prompts):
            steps.append(elapsed)
        prefilled = prefilled or any(o.outputs[0].token_ids for o in outs)
        outputs.update({o.request_id: o for o in outs if o.finished})
    return steps, list(outputs.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="default")
    parser.add_argument("--tokens", type=int, default=64, help="decode steps per measured run (max_tokens)")
    parser.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--compare-xgrammar", action="store_true")
    args = parser.parse_args()

    import torch

    from tsterm.config import SamplingParams, StructuredOutputs
    from tsterm.engine.structured import apply_bitmask, bitmask_words
    from tsterm.launch import load_llm
    from tsterm.profiles import load_profile

    profile = load_profile(args.profile)
    llm = load_llm(profile)
    engine, tokenizer = llm.engine, llm.tokenizer
    vocab = engine.model_config.vocab_size
    schema = _schema()
    spec = StructuredOutputs(json=schema)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Describe a person as JSON: name, age, favourite colour (red, green or blue), "
                                     "hobbies and address."}], add_generation_prompt=True, tokenize=True)
    started = time.perf_counter()
    engine.grammars.compile(spec)
    print(f"profile {profile.name}: {engine.config.model}, vocabulary {vocab}, torch threads "
          f"{torch.get_num_threads()}; llguidance tokenizer + first compile {time.perf_counter() - started:.2f} s",
          file=sys.stderr)

    print("| batch | free decode step, median | constrained step, median | mask fill / step (mean, median, p90, max) "
          "| apply | accept | mask total / free step |")
    print("|---|---|---|---|---|---|---|")
    for batch in [int(b) for b in args.batch.split(",")]:
        # seeded sampling, so the rows differ; ignore_eos keeps the free rows decoding as long as the constrained
        free = SamplingParams(temperature=0.8, seed=1, max_tokens=args.tokens, ignore_eos=True)
        constrained = SamplingParams(temperature=0.8, seed=1, max_tokens=args.tokens, structured_outputs=spec)
        _decode_steps(llm, [prompt] * batch, free)  # warm-up (caches the prompt's blocks for both runs)
        free_steps, _ = _decode_steps(llm, [prompt] * batch, free)
        constrained_steps, outputs = _decode_steps(llm, [prompt] * batch, constrained)
        replies = [o.outputs[0].token_ids for o in outputs]

        # replay the replies through fresh grammars, timing each part of a step alone
        grammars = [engine.grammars.compile(spec) for _ in replies]
        bitmask = torch.empty(len(grammars), bitmask_words(vocab), dtype=torch.int32)
        logits = torch.randn(len(grammars), vocab)
        rows = list(range(len(grammars)))
        fill, apply, accept = [], [], []
        for position in range(max(len(r) for r in replies)):
            live = [i for i, r in enumerate(replies) if position < len(r) and not grammars[i].done]
            if not live:
                break
            t0 = time.perf_counter()
            engine.grammars.fill_bitmask([grammars[i] for i in live], bitmask[:len(live)])
            t1 = time.perf_counter()
            apply_bitmask(logits[:len(live)], rows[:len(live)], bitmask[:len(live)])
            t2 = time.perf_counter()
            for i in live:
                grammars[i].accept(replies[i][position])
            t3 = time.perf_counter()
            fill.append(t1 - t0)
            apply.append(t2 - t1)
            accept.append(t3 - t2)
        f, a, c = _summary(fill), _summary(apply), _summary(accept)
        free_us = statistics.median(free_steps) * 1e6
        total = f["mean"] + a["mean"] + c["mean"]
        print(f"| {batch} | {free_us / 1e3:.2f} ms | {statistics.median(constrained_steps) * 1e3:.2f} ms "
              f"| {f['mean']:.0f} / {f['median']:.0f} / {f['p90']:.0f} / {f['max']:.0f} us | {a['mean']:.0f} us "
              f"| {c['mean']:.0f} us | {total:.0f} us = **{100 * total / free_us:.1f}%** |", flush=True)
        valid = sum(_parses(tokenizer.decode(r)) for r in replies)
        print(f"batch {batch}: {valid} of {len(replies)} constrained replies parse as JSON (cut by max_tokens "
              f"otherwise); {len(fill)} replayed positions", file=sys.stderr)
        if args.compare_xgrammar and batch == 1:
            _xgrammar(engine, schema, replies[0])


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def _xgrammar(engine, schema: dict, reply: list[int]) -> None:
    try:
        import xgrammar
        from transformers import PreTrainedTokenizerFast
    except ImportError as e:
        print(f"xgrammar: not importable ({e})", file=sys.stderr)
        return
    vocab = engine.model_config.vocab_size
    hf = PreTrainedTokenizerFast(tokenizer_object=engine.tokenizer._backend)
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=sorted(engine.eos_token_ids))
    compiled = xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(schema))
    matcher = xgrammar.GrammarMatcher(compiled)
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    fill = []
    for token in reply:
        if matcher.is_terminated():
            break
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        fill.append(time.perf_counter() - t0)
        matcher.accept_token(token)
    s = _summary(fill)
    print(f"xgrammar {version('xgrammar')}, batch 1, the same reply: fill mean {s['mean']:.0f} / median "
          f"{s['median']:.0f} / p90 {s['p90']:.0f} / max {s['max']:.0f} us over {len(fill)} tokens", flush=True)


if __name__ == "__main__":
    main()
