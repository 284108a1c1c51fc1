"""Run a tsterm command over ranks that torchrun starts, on one machine or several:

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-addr HOST0 --master-port 29500 \\
        -m tsterm.distributed.torchrun run --model DIR --tensor-parallel-size 2 --expert-parallel-size 2 --prompt "..."

(the same line on every machine, `--node-rank` 0, 1, ...). Global rank 0 runs the command itself (the CLI, the TUI
or the server, with its engine); every other rank reads the same command line (profile, model, options) and serves
as a worker of that engine until it stops. tensor_parallel_size x expert_parallel_size must equal torchrun's
world size. Ranks find each other through torchrun's rendezvous store; gloo picks the network interface from the
host name (set GLOO_SOCKET_IFNAME to choose one). On CUDA each rank takes the device of its LOCAL_RANK.
"""
from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path

import torch

from tsterm.cli import parse_args
from tsterm.config import EngineConfig, ModelConfig
from tsterm.cpu import quantized_linears
from tsterm.distributed.executor import TORCHRUN_ENV
from tsterm.distributed.worker import WorkerArgs, worker_main
from tsterm.engine.engine import resolve_device, resolve_dtype
from tsterm.engine.executor import ExecutorSpec
from tsterm.launch import engine_options, overrides_from_args, profile_from_args
from tsterm.model.parallel import ParallelLayout


def worker_args(argv: list[str], rank: int, local_rank: int) -> WorkerArgs:
    """What a worker rank needs, from the same command line as rank 0's."""
    args = parse_args(argv)[1]
    model_dir, options = engine_options(profile_from_args(args), getattr(args, "model", None),
                                        **overrides_from_args(args))
    config = EngineConfig.from_options(model_dir, **options)
    device = resolve_device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
    model_config = ModelConfig.from_dir(model_dir)
    quantized = quantized_linears(config.quantization, model_config.quant_method)  # as rank 0's engine decides auto
    spec = ExecutorSpec(config, model_config, Path(model_dir), resolve_dtype(config.dtype, device, quantized), device)
    layout = ParallelLayout(config.tensor_parallel_size, config.expert_parallel_size, rank)
    return WorkerArgs(layout, spec, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                      config.distributed_timeout_s, torch.get_num_threads())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rank = int(os.environ.get("RANK", "0"))
    if "WORLD_SIZE" not in os.environ:
        sys.stderr.write("tsterm.distributed.torchrun: start it with torchrun (RANK, WORLD_SIZE, MASTER_ADDR/PORT are unset)\n")
        return 2
    if rank == 0:
        os.environ[TORCHRUN_ENV] = "1"  # the engine attaches to torchrun's ranks instead of starting workers
        from tsterm.cli import main as cli_main

        return cli_main(argv)
    worker_main(worker_args(argv, rank, int(os.environ.get("LOCAL_RANK", "0"))))
    return 0


def exit_now(code: int) -> None:
    """Exit with `code` once the exit hooks (the engine's stop to the other ranks among them) have run, skipping the
    interpreter's teardown: there, gloo's groups (built without a default process group) sometimes end a process
    whose command had succeeded with std::terminate ("terminate called without an active exception", exit -6: in
    two full-suite runs of tests/distributed/test_torchrun.py, sessions 15 and 16)."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
