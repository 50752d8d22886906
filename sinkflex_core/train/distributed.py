"""Distributed set-up: the process group torchrun asks for (RANK / WORLD_SIZE / LOCAL_RANK), the
reduction of metrics over ranks, and FSDP2 sharding of the policy. On one process every call here is
the identity, so the trainer reads the same with 1 or N processes."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.enabled:
            torch.distributed.barrier()

    def reduce(self, values: dict[str, float], op: str = "sum") -> dict[str, float]:
        """``values`` combined over ranks, key by key: ``op`` ``"sum"`` or ``"max"`` (float64, so
        that counts stay exact). Every rank gets the same dict back."""
        if op not in ("sum", "max"):
            raise ValueError(f"op must be 'sum' or 'max', got {op!r}")
        if not self.enabled:
            return dict(values)
        keys = list(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM if op == "sum"
                                     else torch.distributed.ReduceOp.MAX)
        return dict(zip(keys, t.tolist()))

    def gather_objects(self, obj) -> list:
        if not self.enabled:
            return [obj]
        out = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out


def init_distributed() -> Dist:
    """Join the process group when launched by torchrun (gloo on CPU, NCCL on GPUs)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        return Dist(device=device)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend=backend)
    return Dist(rank=rank, world=world, local_rank=local_rank, device=device)


def shard_model(module: torch.nn.Module, dist: Dist, bfloat16: bool) -> None:
    """FSDP2: one ``fully_shard`` per decoder layer (their weights are gathered one layer at a time),
    then the root (embeddings, final norm, output layer). ``module`` is a
    :class:`sinkflex_core.train.policy.TokenLogprobs`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from .policy import causal_lm

    mesh = init_device_mesh(dist.device.type, (dist.world,))
    mp = MixedPrecisionPolicy()
    if bfloat16:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in causal_lm(module.lm).model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(module, mesh=mesh, mp_policy=mp)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) value gathered whole; a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
