"""One rank's view of the tensor-parallel job: its rank, the world size and two groups.

Two process groups over the same ranks, because two kinds of traffic cross them:
  - `device_group` carries activations (the all-reduce after each row-parallel projection, the
    all-gather of vocabulary shards): NCCL on GPUs (capturable inside CUDA graphs), gloo on the
    CPU. Every rank issues these in the same order because every rank runs the same step.
  - `cpu_group` (gloo) carries the host's decisions: rank 0's step header (new requests,
    aborts, stops, the policy's cell) and each plan's digest. It never touches the device, so
    sharing a decision costs no host sync of the GPU stream.

Nothing here is a module global: the engine builds one TensorParallel and hands it to the
model, whose layers keep it (None: one rank, no collectives anywhere).
"""

from __future__ import annotations

import datetime
import logging
import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# how long a collective may wait for a peer before torch.distributed raises; a dead peer is
# normally noticed sooner (its sockets close, and the watchdogs in launch.py end the job)
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class TensorParallel:
    rank: int
    size: int
    device_group: dist.ProcessGroup
    cpu_group: dist.ProcessGroup

    @property
    def is_driver(self) -> bool:
        """Rank 0: owns the scheduler's decisions, the tokenizer and the API."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks, in place (every rank gets the same bytes)."""
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:  # [N, v] -> [N, size v]
        """The ranks' shards side by side along the last dimension, rank order."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0's `obj` on every rank (the others pass None): pickled, length first.

        Two gloo broadcasts of int64/uint8 tensors on the host; a header of a few requests is
        a few hundred bytes."""
        if self.is_driver:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            length = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            length = torch.empty(1, dtype=torch.int64)
        dist.broadcast(length, 0, group=self.cpu_group)
        if not self.is_driver:
            data = torch.empty(int(length), dtype=torch.uint8)
        dist.broadcast(data, 0, group=self.cpu_group)
        return obj if self.is_driver else pickle.loads(data.numpy().tobytes())

    def min_over_ranks(self, value: int) -> int:
        """The smallest of each rank's `value` (the KV pages every rank can hold)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t)


def init_tensor_parallel(rank: int, size: int, port: int, device: torch.device) -> TensorParallel:
    """Join the job at tcp://127.0.0.1:port (all ranks on this host). NCCL for a CUDA device,
    gloo otherwise; a gloo group beside it for the host's decisions."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
        timeout=COLLECTIVE_TIMEOUT,
    )  # fmt: skip
    world = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo") if backend != "gloo" else world
    return TensorParallel(rank, size, world, cpu_group)


def abort_tensor_parallel(rank: int, code: int) -> None:
    """A worker exited mid-job (launch.Workers.watch, NCCL): abort every communicator, so that
    a collective waiting for it fails instead of waiting out COLLECTIVE_TIMEOUT."""
    logger.error("tensor-parallel rank %d exited with code %d: aborting the collectives",
                 rank, code)  # fmt: skip
    if dist.is_initialized():  # (torch's abort of every group: experimental, NCCL's)
        dist.distributed_c10d._abort_process_group()


def destroy_tensor_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
