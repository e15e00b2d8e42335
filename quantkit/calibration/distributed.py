"""Data-parallel calibration on torch.distributed: who this process is, and the reductions algorithms need.

Under `torchrun --nproc-per-node N -m quantkit quantize ...` (or `quantkit quantize --nproc N`, which
launches exactly that) every process runs the same job on its share of the calibration batches
(`World.shard`: batch i goes to rank i mod N). Each layer's statistics are then reduced over the
process group where the algorithm makes them, so every rank holds the same totals:
- GPTQ: the Hessian sums and their token counts (`sum_`); AWQ: activation magnitude sums, token
  counts, clip Hessians and each candidate scale's squared error and element count;
- FP8 static activation scales and KV-cache scales: absmax (`max_`); the mse observer's samples
  are gathered (`gather_`);
and the GPTQ solves are shared out by linear group, largest first (`owner_of`), their results
broadcast from the rank that solved them. Rank 0 alone writes the checkpoint. gloo on CPU, nccl
on CUDA. A collective that fails or waits past `timeout_s` (another rank died or hangs) raises
`DistributedError` naming the ranks that never arrived and the last operation each entered (every
rank records its step in the process group's store before each collective); under the launcher,
torch's elastic agent then stops the other ranks, and names the one that failed.

One process is `World()` (size 1): every method is then the identity, at no cost.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from quantkit.errors import QuantizationError

DEFAULT_TIMEOUT_S = 600.0  # a collective waits this long for the other ranks


class DistributedError(QuantizationError):
    """A distributed run cannot start, or another rank died or hangs."""


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    backend: Optional[str] = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    _steps: list = field(default_factory=lambda: [0], compare=False, repr=False)  # collectives entered

    @property
    def active(self) -> bool:
        return self.size > 1

    @property
    def is_writer(self) -> bool:
        """Only rank 0 writes files (the checkpoint, its report)."""
        return self.rank == 0

    def shard(self, items: Sequence) -> list:
        return list(items[self.rank :: self.size])

    def _run(self, what: str, fn, *args):
        """One collective. Before it, this rank's step (a count and the operation's name) goes into the
        process group's key-value store, so a rank that times out can name the ranks that never arrived."""
        self._steps[0] += 1
        step = self._steps[0]
        store = _store()
        if store is not None:
            try:
                store.set(f"quantkit/step/{self.rank}", f"{step}\t{what}")
            except Exception:  # the store is only for the message: never a reason to fail
                store = None
        try:
            return fn(*args)
        except RuntimeError as exc:
            behind = self._behind(store, step)
            raise DistributedError(f"rank {self.rank} of {self.size}: collective #{step} ({what}) failed or timed out "
                                   f"after {self.timeout_s:.0f} s" + (f": {behind}" if behind else
                                                                      ": another rank died or hangs")
                                   + f" ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from exc

    def _behind(self, store, step: int) -> str:
        """Which ranks had not reached collective #step, with the last one each did enter."""
        if store is None:
            return ""
        lagging = []
        for r in range(self.size):
            if r == self.rank:
                continue
            try:
                store.set_timeout(datetime.timedelta(seconds=2))
                last, _, op = store.get(f"quantkit/step/{r}").decode().partition("\t")
            except Exception:
                lagging.append(f"rank {r} never reached a collective")
                continue
            if int(last) < step:
                lagging.append(f"rank {r} is behind, stuck after collective #{last} ({op})")
        return "; ".join(lagging)

    def sum_(self, t: torch.Tensor, what: str = "sum") -> torch.Tensor:
        """Sum `t` over the ranks, in place (every rank gets the total)."""
        if self.active:
            import torch.distributed as dist

            self._run(what, dist.all_reduce, t, dist.ReduceOp.SUM)
        return t

    def max_(self, t: torch.Tensor, what: str = "max") -> torch.Tensor:
        if self.active:
            import torch.distributed as dist

            self._run(what, dist.all_reduce, t, dist.ReduceOp.MAX)
        return t

    def sum_numbers(self, values: Sequence[float], what: str = "sum", device=None) -> list[float]:
        """Sum a few Python numbers over the ranks (in float64)."""
        if not self.active:
            return list(values)
        return self.sum_(torch.tensor(list(values), dtype=torch.float64, device=device), what).tolist()

    def gather_(self, t: torch.Tensor, what: str = "gather") -> torch.Tensor:
        """Every rank's 1-D `t` (lengths may differ), concatenated in rank order."""
        if not self.active:
            return t
        import torch.distributed as dist

        n = torch.tensor([t.numel()], device=t.device)
        sizes = [torch.zeros_like(n) for _ in range(self.size)]
        self._run(what, dist.all_gather, sizes, n)
        width = int(max(s.item() for s in sizes))
        padded = torch.zeros(width, dtype=t.dtype, device=t.device)
        padded[: t.numel()] = t.reshape(-1)
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        self._run(what, dist.all_gather, parts, padded)
        return torch.cat([p[: int(s.item())] for p, s in zip(parts, sizes)])

    def broadcast_object(self, obj: Any, src: int, what: str = "broadcast") -> Any:
        """`obj` from rank `src` on every rank (pickled between quantkit's own ranks of this run only)."""
        if not self.active:
            return obj
        import torch.distributed as dist

        box = [obj if self.rank == src else None]
        self._run(what, dist.broadcast_object_list, box, src)
        return box[0]

    def barrier(self, what: str = "barrier") -> None:
        if self.active:
            import torch.distributed as dist

            self._run(what, dist.barrier)


def _store():
    """The key-value store of the default process group (torchrun's), or None."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:
        return None


def owner_of(sizes: Sequence[int], world_size: int) -> list[int]:
    """The rank that solves each job (by size, largest first, each to the least loaded rank; ties to
    the lower rank): deterministic, so every rank computes the same assignment."""
    load = [0] * world_size
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


_CURRENT = World()


def current() -> World:
    """The world of this process (size 1 unless `init` made a process group)."""
    return _CURRENT


def env_world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def init(device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S) -> World:
    """Join the process group torchrun describes in the environment (WORLD_SIZE > 1), or stay alone."""
    global _CURRENT
    size = env_world_size()
    if size <= 1:
        _CURRENT = World(timeout_s=timeout_s)
        return _CURRENT
    import torch.distributed as dist

    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise DistributedError(f"WORLD_SIZE={size} but {', '.join(missing)} not set: start distributed runs with "
                               "torchrun (or quantkit quantize --nproc N)")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    _CURRENT = World(dist.get_rank(), dist.get_world_size(), backend, timeout_s)
    return _CURRENT


def shutdown() -> None:
    global _CURRENT
    if _CURRENT.active:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    _CURRENT = World()
