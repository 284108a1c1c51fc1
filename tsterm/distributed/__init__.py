"""Tensor and expert parallelism on torch.distributed: the rank-0 executor and its worker processes.

`DistributedExecutor` is an `ExecutorFactory` (`tsterm.engine.executor`): the launcher hands it to the engine when
`tensor_parallel_size x expert_parallel_size > 1`; the engine itself never imports this package.
"""
from tsterm.distributed.executor import DistributedExecutor

__all__ = ["DistributedExecutor"]
