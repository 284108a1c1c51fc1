"""TTFT of a long session's next turn after a restart: tsterm reading its KV from the disk tier, tsterm computing it
again, and (for a model with a GGUF file) llama.cpp restoring a saved state, measured in one run.

    python benchmarks/kv_disk_tier.py [--profile bench] [--tokens 16384] [--reply 32] [--new 64] [--rounds 2]
                                      [--cold] [--llama-cpp] [--write-overhead] [--store DIR]

Each new engine first runs a short unrelated request (untimed: its weights' pages and kernels warm, as a restarted
server's are by the time a user's turn arrives). Turn 1 (a prompt of about `--tokens` tokens, a greedy reply of `--reply`) runs on an engine with `kv_disk` over a
fresh store, which is then shut down (its queued writes finish). Each round then starts new engines, as a restarted
process would (their start is not timed), and times turn 2 (turn 1's prompt and reply plus `--new` new tokens, a
different tail each round) from `add_request` to its first token: one engine over the store (the previous turn read
from disk), one without it (all of it computed), alternating. `--cold` drops the store's files from the page cache
before each read (posix_fadvise DONTNEED after fdatasync); without it they are read from the page cache, as right
after a restart. `--llama-cpp` (the default model: its GGUF file) adds llama-cpp-python: turn 1 evaluated, its state
saved to a file (`save_state`, pickled), and in a new `Llama` the file loaded (`load_state`) and turn 2's new tokens
evaluated up to the first token, against the same `Llama` evaluating all of turn 2. `--write-overhead` also times
turn 1's prefill with and without the disk tier, alternating (the cost of the write-through). Token ids are random (KV costs do not depend on them).
"""
from __future__ import annotations

import argparse
import gc
import os
import pickle
import random
import shutil
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="bench", help="the profile whose model and engine options to run")
    parser.add_argument("--tokens", type=int, default=16384,
                        help="the session's length at turn 2 (capped at the profile's max_model_len)")
    parser.add_argument("--reply", type=int, default=32, help="turn 1's reply tokens")
    parser.add_argument("--new", type=int, default=64, help="turn 2's new prompt tokens")
    parser.add_argument("--rounds", type=int, default=2, help="alternating measurements of each (all printed)")
    parser.add_argument("--cold", action="store_true", help="read the store from the disk, not the page cache")
    parser.add_argument("--llama-cpp", action="store_true", help="also llama.cpp restoring a saved state")
    parser.add_argument("--write-overhead", action="store_true", help="also time turn 1 without the disk tier")
    parser.add_argument("--store", help="the disk tier's directory (default: a new temporary one, deleted after)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="llama.cpp's threads")
    args = parser.parse_args()

    from tsterm import LLM, SamplingParams
    from tsterm.bench.machine import cpu_description

    store = Path(args.store) if args.store else Path(tempfile.mkdtemp(prefix="tsterm-kv-bench-"))
    kv_disk = {"path": str(store), "max_bytes": 64 << 30}
    print(f"CPU: {cpu_description()}")
    print(f"profile {args.profile}; store {store}{' (cold: page cache dropped before reads)' if args.cold else ''}")

    def ttft(llm: LLM, ids: list[int]) -> tuple[float, object]:
        engine = llm.engine
        # a restarted server has run something before: the weights' pages and the kernels' first calls are warm
        llm.generate([7 + i for i in range(24)], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        start = time.perf_counter()
        engine.add_request(ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        while True:
            for out in engine.step():
                if out.finished:
                    return time.perf_counter() - start, out

    def close(llm: LLM) -> None:
        llm.engine.shutdown()
        del llm
        gc.collect()

    llm = LLM.from_profile(args.profile, kv_disk=kv_disk)
    limit = llm.engine.max_model_len
    vocab = llm.engine.model_config.vocab_size
    total = min(args.tokens, limit - 8)
    rng = random.Random(0)
    prompt = [rng.randrange(100, vocab - 100) for _ in range(total - args.reply - args.new)]
    start = time.perf_counter()
    first = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=args.reply, ignore_eos=True))[0]
    turn1_tier = time.perf_counter() - start
    close(llm)
    conversation = prompt + list(first.token_ids)
    stored = sum(p.stat().st_size for p in store.iterdir() if p.is_file())
    print(f"turn 1: {len(prompt)} prompt + {len(first.token_ids)} reply tokens in {turn1_tier:.2f} s with the disk "
          f"tier; store {stored / (1 << 20):.1f} MiB")
    if args.write_overhead:  # turn 1's prefill with and without the write-through, alternating, each engine warm
        times: dict[str, list[float]] = {"with": [], "without": []}
        for round_index in range(args.rounds):
            for kind in (("with", "without") if round_index % 2 == 0 else ("without", "with")):
                fresh = Path(tempfile.mkdtemp(prefix="tsterm-kv-write-"))
                options = {"kv_disk": {"path": str(fresh), "max_bytes": 64 << 30}} if kind == "with" else {}
                llm = LLM.from_profile(args.profile, **options)
                times[kind].append(ttft(llm, prompt)[0])
                close(llm)  # (its queued writes finish here, untimed: they overlap the next step's compute)
                shutil.rmtree(fresh, ignore_errors=True)
        with_tier, without = min(times["with"]), min(times["without"])
        print(f"turn 1's prefill ({len(prompt)} tokens, to its first token): with the write-through {with_tier:.2f} s, "
              f"without {without:.2f} s ({(with_tier / without - 1) * 100:+.1f}%); all: {times}")

    rows = []
    for round_index in range(args.rounds):
        tail = [random.Random(100 + round_index).randrange(100, vocab - 100) for _ in range(args.new)]
        turn2 = conversation + tail
        order = ("disk", "recompute") if round_index % 2 == 0 else ("recompute", "disk")
        firsts = {}
        for kind in order:
            if kind == "disk":
                if args.cold:
                    drop_page_cache(store)
                llm = LLM.from_profile(args.profile, kv_disk=kv_disk)
            else:
                llm = LLM.from_profile(args.profile)
            seconds, out = ttft(llm, turn2)
            stats = llm.stats()
            firsts[kind] = out.token_ids
            rows.append((round_index, kind, len(turn2), out.num_cached_tokens, seconds,
                         stats.get("kv_disk_load_seconds", 0.0), stats.get("kv_disk_read_bytes", 0)))
            close(llm)
        if firsts["disk"] != firsts["recompute"]:  # (reported, not raised: the timings are still worth printing)
            print(f"round {round_index}: THE FIRST TOKENS DIFFER: {firsts}")

    print(f"\n{'round':>5} {'tsterm':<10} {'prompt':>7} {'cached':>7} {'TTFT s':>8} {'load s':>7} {'read MiB':>9}")
    for round_index, kind, n, cached, seconds, load, read in rows:
        print(f"{round_index:>5} {kind:<10} {n:>7} {cached:>7} {seconds:>8.3f} {load:>7.3f} {read / (1 << 20):>9.1f}")
    by = {kind: [r[4] for r in rows if r[1] == kind] for kind in ("disk", "recompute")}
    for round_index in range(args.rounds):
        disk, recompute = (r[4] for r in sorted((r for r in rows if r[0] == round_index), key=lambda r: r[1]))
        print(f"round {round_index}: recompute / disk = {recompute / disk:.1f}x")
    print(f"best of each: recompute {min(by['recompute']):.3f} s, from disk {min(by['disk']):.3f} s: "
          f"{min(by['recompute']) / min(by['disk']):.1f}x")

    if args.llama_cpp:
        llama_cpp_restore(args, conversation, [random.Random(100).randrange(100, vocab - 100)
                                               for _ in range(args.new)], min(by["disk"]))
    if not args.store:
        shutil.rmtree(store, ignore_errors=True)


def llama_cpp_restore(args, conversation: list[int], tail: list[int], tsterm_disk: float) -> None:
    """llama-cpp-python on the profile model's GGUF: turn 1 evaluated and its state saved to a file; a new `Llama`
    loads it and evaluates turn 2's tail to its first token (timed from the file's read), against the same `Llama`
    evaluating all of turn 2."""
    from tsterm.bench.llama_cpp import gguf_source, open_llama
    from tsterm.launch import engine_config
    from tsterm.profiles import load_profile

    gguf = gguf_source(engine_config(load_profile(args.profile)).model)
    n_ctx = len(conversation) + len(tail) + 16
    llama = open_llama(gguf, n_ctx, args.threads)
    llama.eval(conversation[:-1])  # (as tsterm: the reply's last token is fed with the next turn)
    path = Path(tempfile.mkdtemp(prefix="tsterm-llama-state-")) / "state.pkl"
    start = time.perf_counter()
    with open(path, "wb") as f:
        pickle.dump(llama.save_state(), f)
    saved = time.perf_counter() - start
    size = path.stat().st_size
    del llama
    gc.collect()
    results = {}
    for kind in ("restore", "recompute", "restore", "recompute")[:2 * args.rounds]:
        llama = open_llama(gguf, n_ctx, args.threads)  # a restarted process (not timed)
        if kind == "restore" and args.cold:
            drop_page_cache(path.parent)
        start = time.perf_counter()
        if kind == "restore":
            with open(path, "rb") as f:
                llama.load_state(pickle.load(f))
            llama.eval([conversation[-1], *tail])
        else:
            llama.eval(conversation + tail)
        llama.sample(top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0)
        results.setdefault(kind, []).append(time.perf_counter() - start)
        del llama
        gc.collect()
    shutil.rmtree(path.parent, ignore_errors=True)
    restore, recompute = min(results["restore"]), min(results["recompute"])
    print(f"\nllama.cpp ({gguf.name}, {args.threads} threads): state {size / (1 << 20):.1f} MiB saved in {saved:.2f} s; "
          f"TTFT restored {restore:.3f} s, recomputed {recompute:.3f} s ({recompute / restore:.1f}x); "
          f"tsterm from disk {tsterm_disk:.3f} s: llama.cpp restore / tsterm disk = {restore / tsterm_disk:.2f}x")
    print("  all llama.cpp runs: " + ", ".join(f"{k} {v:.3f}" for k, vs in results.items() for v in vs))


def drop_page_cache(folder: Path) -> None:
    """Ask the kernel to drop the files of `folder` from the page cache (written out first)."""
    for path in folder.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


if __name__ == "__main__":
    main()
