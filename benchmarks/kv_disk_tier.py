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

    python benchmarks/kv_disk_tier.py --trace [--profile bench] [--sessions 8] [--turns 6] [--system-tokens 1024]
                                      [--turn-tokens 128] [--output-tokens 16] [--pool-fraction 0.25] [--rounds 2]

`--trace`: instead, the bench trace (`tsterm bench`'s synthetic agent trace: a shared system prompt, `--sessions`
sessions of `--turns` turns run at once) replayed with a device pool of `--pool-fraction` of its working set (the
distinct blocks of every session's whole conversation), without lower tiers (what the pool evicts is computed again)
and with a host tier holding the whole working set (`kv_host_bytes`; `--with-disk` adds a disk store under it), and
with a pool of the whole working set (the bound), alternating round by round: wall time, the prefix hits against what
the cache could hit at most (`hit_rate_vs_theoretical`), prompt tokens computed, and tokens served by each tier. Every
replay's greedy outputs are compared with the full pool's.
"""
from __future__ import annotations

import argparse
import gc
import os
import pickle
import random
import shutil
import statistics
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
    parser.add_argument("--trace", action="store_true", help="the bench trace with a pool of --pool-fraction of its "
                        "working set, with and without the host tier")
    parser.add_argument("--sessions", type=int, default=8, help="--trace: sessions at once")
    parser.add_argument("--turns", type=int, default=6, help="--trace: turns per session")
    parser.add_argument("--system-tokens", type=int, default=1024, help="--trace: the shared system prompt")
    parser.add_argument("--turn-tokens", type=int, default=128, help="--trace: new tokens per later turn")
    parser.add_argument("--output-tokens", type=int, default=16, help="--trace: reply tokens per turn")
    parser.add_argument("--pool-fraction", type=float, default=0.25, help="--trace: the device pool's share of the "
                        "working set")
    parser.add_argument("--with-disk", action="store_true", help="--trace: a disk store under the host tier too")
    args = parser.parse_args()
    if args.trace:
        trace_mode(args)
        return

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
                         stats.get("kv_tier_load_seconds", 0.0), stats.get("kv_disk_read_bytes", 0)))
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


def trace_mode(args) -> None:
    """The bench trace over a pool of `args.pool_fraction` of its working set: no lower tier, the host tier (and
    a disk store under it with --with-disk), and the whole working set in the pool, alternating by round."""
    from tsterm import LLM
    from tsterm.bench.machine import cpu_description
    from tsterm.bench.replay import replay_tsterm, warm_up
    from tsterm.bench.trace import TraceSpec, make_trace

    spec = TraceSpec(args.sessions, args.turns, args.system_tokens, 64, args.turn_tokens, args.output_tokens)
    probe = LLM.from_profile(args.profile)
    block, per_block = probe.engine.config.block_size, probe.engine.executor.kv_bytes_per_block
    trace = make_trace(spec, probe.engine.model_config.vocab_size)
    probe.engine.shutdown()
    del probe
    gc.collect()
    # the working set: the shared system prompt's blocks once, then each session's own (task, turns, replies)
    own = sum(len(t.new_ids) + t.output_tokens for t in trace[0]) - spec.system_tokens
    working = -(-spec.system_tokens // block) + spec.sessions * -(-own // block)
    longest = -(-(spec.system_tokens + own) // block)  # one conversation's blocks: what the pool must hold at least
    pool = max(int(working * args.pool_fraction), longest + 2)
    print(f"CPU: {cpu_description()}")
    print(f"profile {args.profile}; trace {spec.sessions} sessions x {spec.turns} turns, system {spec.system_tokens}, "
          f"turn {spec.turn_tokens}, reply {spec.output_tokens}; working set {working} blocks of {block} tokens "
          f"({working * per_block / (1 << 20):.1f} MiB); pool {pool} blocks ({pool / working:.2f} of it; one "
          f"conversation needs {longest})")
    store = Path(tempfile.mkdtemp(prefix="tsterm-kv-trace-"))
    kinds = {"no tier": dict(num_kv_blocks=pool),
             "host tier": dict(num_kv_blocks=pool, kv_host_bytes=working * per_block),
             "whole pool": dict(num_kv_blocks=working + 2)}
    if args.with_disk:
        kinds["host tier"]["kv_disk"] = {"path": str(store), "max_bytes": 2 * working * per_block + (64 << 20)}
    rows, outputs = [], {}
    for round_index in range(args.rounds):
        order = list(kinds) if round_index % 2 == 0 else list(reversed(kinds))
        for kind in order:
            llm = LLM.from_profile(args.profile, **kinds[kind])
            warm_up(llm.engine)
            before = llm.stats()
            result = replay_tsterm(llm.engine, trace, kind.replace(" ", "-"))
            stats = llm.stats()
            outputs.setdefault(kind, result.outputs())
            rows.append((round_index, kind, result.wall_s, result.hit_rate_vs_theoretical(),
                         stats["prefill_tokens"] - before["prefill_tokens"], stats.get("kv_host_hit_tokens", 0),
                         stats.get("kv_disk_hit_tokens", 0), stats.get("evictions", 0)))
            llm.engine.shutdown()
            del llm
            gc.collect()
            for path in store.iterdir():  # (each replay starts with an empty store)
                if path.is_file():
                    path.unlink()
    shutil.rmtree(store, ignore_errors=True)
    print(f"\n{'round':>5} {'pool':<11} {'wall s':>8} {'hit rate':>9} {'computed':>9} {'host tok':>9} "
          f"{'disk tok':>9} {'evictions':>9}")
    for round_index, kind, wall, rate, computed, host, disk, evictions in rows:
        print(f"{round_index:>5} {kind:<11} {wall:>8.2f} {rate:>9.3f} {computed:>9} {host:>9} {disk:>9} {evictions:>9}")
    ratios = []
    for round_index in range(args.rounds):
        wall = {r[1]: r[2] for r in rows if r[0] == round_index}
        ratios.append((wall["no tier"] / wall["host tier"], wall["host tier"] / wall["whole pool"]))
        print(f"round {round_index}: no tier / host tier = {ratios[-1][0]:.2f}x, "
              f"host tier / whole pool = {ratios[-1][1]:.2f}x")
    print(f"median of the rounds: no tier / host tier = {statistics.median(r[0] for r in ratios):.2f}x, "
          f"host tier / whole pool = {statistics.median(r[1] for r in ratios):.2f}x")
    for kind, got in outputs.items():
        if got != outputs["whole pool"]:
            print(f"{kind}: THE GREEDY OUTPUTS DIFFER from the whole pool's")


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
