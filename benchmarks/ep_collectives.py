"""Expert-parallel combine: the all-reduce tsterm uses against an all-to-all dispatch, measured on gloo CPU ranks.

tsterm's ranks all hold the whole batch (rank 0 schedules one batch for every rank), so its EP MoE has each rank run
its own experts on the tokens routed to them and sums the partial outputs with one all-reduce of [T, H]. The
alternative (DeepSpeed-MoE / vLLM's all-to-all backends) shards the tokens: each rank routes its T/W tokens, sends
each token's hidden state to the ranks holding its top-k experts (all-to-all), gets the expert outputs back (a
second all-to-all), and, for the next attention layer that needs every token, gathers the shards (all-gather).
This script times exactly those collectives, side by side in one run, for a range of batch sizes, with uniform
random routing:

    python benchmarks/ep_collectives.py [--ranks 2] [--hidden 2048] [--experts 128] [--top-k 8]

It prints one row per batch size: milliseconds per MoE layer for each scheme and their ratio.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BATCHES = (1, 4, 16, 64, 256, 1024)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(fn, repeats: int) -> float:
    """Median milliseconds of `fn()` (after two warm-up calls), agreed on by every rank (the slowest)."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    result = torch.tensor([statistics.median(samples)])
    dist.all_reduce(result, op=dist.ReduceOp.MAX)
    return float(result)


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    generator = torch.Generator().manual_seed(rank)
    experts_per_rank = args.experts // world
    rows = []
    for batch in BATCHES:
        hidden = torch.randn(batch, args.hidden, generator=generator)

        def all_reduce() -> None:
            dist.all_reduce(hidden.clone())

        shard = max(1, batch // world)
        mine = torch.randn(shard, args.hidden, generator=generator)
        # where my tokens' top-k experts live: the number of (token, expert) pairs sent to each rank
        experts = torch.stack([torch.randperm(args.experts, generator=generator)[:args.top_k] for _ in range(shard)])
        to_rank = torch.bincount((experts // experts_per_rank).flatten(), minlength=world)
        send_sizes = to_rank.tolist()
        recv = torch.empty(world, dtype=torch.long)
        dist.all_to_all_single(recv, to_rank)  # the sizes every rank will send me
        recv_sizes = recv.tolist()
        send = mine.repeat_interleave(args.top_k, dim=0)[:sum(send_sizes)]
        gathered = [torch.empty(shard, args.hidden) for _ in range(world)]

        def all_to_all() -> None:
            received = torch.empty(sum(recv_sizes), args.hidden)
            dist.all_to_all_single(received, send, recv_sizes, send_sizes)  # dispatch
            back = torch.empty(sum(send_sizes), args.hidden)
            dist.all_to_all_single(back, received, send_sizes, recv_sizes)  # combine
            dist.all_gather(gathered, mine)  # every rank needs every token for the next attention layer

        rows.append((batch, timed(all_reduce, args.repeats), timed(all_to_all, args.repeats)))
    if rank == 0:
        out["rows"] = rows
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size (Qwen3-30B-A3B: 2048)")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8, dest="top_k")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(rank_main, args=(args.ranks, free_port(), args, out), nprocs=args.ranks, join=True)
        rows = out["rows"]
    print(f"EP combine on {args.ranks} gloo CPU ranks, hidden {args.hidden}, {args.experts} experts top-{args.top_k}"
          " (ms per MoE layer, median, slowest rank)")
    print(f"{'tokens':>7} {'all-reduce':>11} {'all-to-all':>11} {'a2a / ar':>9}")
    for batch, ar, a2a in rows:
        print(f"{batch:>7} {ar:>11.3f} {a2a:>11.3f} {a2a / ar:>9.2f}")


if __name__ == "__main__":
    main()
