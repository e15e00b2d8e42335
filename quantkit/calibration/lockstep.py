"""One decoder layer run over every calibration batch in lock step, every batch paused at each linear group.

True-sequential quantization calibrates each group of linears that read one input (q/k/v, o, gate/up,
down) on what the layer computes with the groups before it already quantized, over all the
batches, before that group's own weights change. Its textbook form runs the layer once per group
(GPTQModel's and AutoGPTQ's `true_sequential`); a single forward does the same if every batch can
stop at a group until all the others have reached it, and a module's forward cannot pause. So here
each batch's forward runs in a thread of its own (kept between passes), a few at a time (the caller's
thread hands out the turns and waits), and a pre-hook on each group's linears parks the batch there. When
every batch is parked or finished, the earliest group waited on is handed to `at_group` (in the
caller's thread), its batches go on, and so on: one forward per layer gives each group the
same inputs as the textbook form, in the same batch order, and the layer's quantized outputs.

Memory: every batch's forward is in flight at once, so each holds its intermediate tensors (about
the residual, the group input and an MLP intermediate per token) until the pass ends.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import nn

from quantkit.errors import QuantizationError


class _Abort(BaseException):
    """Unwinds a parked batch's forward when the pass is abandoned (another batch failed, an interrupt)."""


class _Worker:
    """A thread that runs one batch's forward at a time. Workers are kept between passes (an idle one
    waits on its queue): a fresh thread per batch and layer paid for its own OpenMP pool and malloc
    arena every time, which cost ~10% of a layer's forward."""

    _idle: list["_Worker"] = []
    _busy = 0
    _lock = threading.Lock()
    _count = 0

    def __init__(self):
        _Worker._count += 1
        self.jobs: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=f"quantkit-lockstep-{_Worker._count}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            self.jobs.get()()  # a job never raises (`work` keeps what it raised for the caller)
            with _Worker._lock:
                _Worker._idle.append(self)

    @classmethod
    def finished(cls) -> None:
        """Called by a job as its last step."""
        with cls._lock:
            cls._busy -= 1

    @classmethod
    def run(cls, job: Callable[[], None]) -> None:
        """Run `job` on an idle worker (a new one if none is idle)."""
        with cls._lock:
            worker = cls._idle.pop() if cls._idle else None
            cls._busy += 1
        (worker or cls()).jobs.put(job)


def busy_workers() -> int:
    """How many lock-step workers are running a batch (0 once every pass has ended)."""
    return _Worker._busy


@dataclass
class _Batch:
    index: int
    go: threading.Event
    state: str = "new"  # new -> running -> parked / done / failed / aborted
    group: int = -1  # the group it is parked at
    pending: Optional[torch.Tensor] = None  # its input to that group, observed when the group's turn comes
    hidden: Optional[torch.Tensor] = None
    output: Any = None
    error: Optional[BaseException] = None
    ended: threading.Event = field(default_factory=threading.Event)  # its job has returned
    seen: set = field(default_factory=set)  # the groups this batch has reached


@torch.no_grad()
def drive_in_lockstep(
    layer: nn.Module,
    hidden: Iterable[torch.Tensor],
    kwargs: Sequence[dict],
    groups: Sequence[Sequence[nn.Module]],
    on_input: Callable[[int, torch.Tensor], None],
    at_group: Callable[[int], None],
    outputs: Optional[list] = None,
    names: Optional[Sequence[str]] = None,
    parallel: Optional[int] = None,
    threads_each: Optional[int] = None,
) -> Optional[list]:
    """Run `layer` on every (hidden, kwargs) batch, pausing all of them before each group of `groups`.

    on_input(g, x): a batch's input `x` to group g (its linears share it), before the group is quantized;
    called from the caller's thread, batch by batch in order, once every batch has reached g.
    at_group(g): every batch has given its input to group g (or finished without reaching it): quantize
    it now; the batches then run on with its new weights. outputs: a list (or an `Activations`) the layer's
    outputs are appended to in batch order, and returned. names: each group's name, for errors.
    parallel: how many batches compute at once between stops, each on `threads_each` intra-op threads
    (default: `_lanes`, one batch per intra-op thread on a CPU, one at a time on an accelerator).
    Statistics and results do not depend on it beyond the float order of the
    batches' own ops; the observations are made in batch order whatever the batches' timing.
    A batch that reaches a group after it was quantized (the layer calls its linears in an order that
    differs between batches) is an error, never statistics missing a batch.
    """
    kwargs = list(kwargs)
    where = {id(m): g for g, group in enumerate(groups) for m in group}
    done: set[int] = set()
    cv = threading.Condition()
    running = [0]
    abort = [False]
    local = threading.local()
    if parallel is None:
        parallel, threads_each = _lanes(groups, hidden)
    threads = threads_each or torch.get_num_threads()

    def hand_back(batch: _Batch, state: str) -> None:
        """The batch stops running (parked, or ended); parking is refused once the pass is abandoned, under the
        same lock as the cleanup's look at the states, so no batch is ever parked unseen by it."""
        with cv:
            if state == "parked" and abort[0]:
                raise _Abort
            batch.state = state
            running[0] -= 1
            cv.notify_all()

    def label(g: int) -> str:
        return names[g] if names else f"group {g}"

    def park(module: nn.Module, args: tuple) -> None:
        if abort[0]:
            raise _Abort
        g = where[id(module)]
        batch: _Batch = local.batch
        if g in batch.seen:
            return  # this batch gave the group its input at the group's first linear; the rest read the same
        if g in done:
            raise QuantizationError(
                f"calibration batch {batch.index} reached {label(g)} after it was quantized: this layer calls its "
                "linears in an order that differs between batches, which a single true-sequential pass cannot "
                "follow; set true_sequential: false for this stage")
        batch.seen.add(g)
        batch.group, batch.pending = g, args[0]
        hand_back(batch, "parked")
        batch.go.wait()
        batch.go.clear()
        if abort[0]:
            raise _Abort

    def work(batch: _Batch) -> None:
        local.batch = batch
        torch.set_num_threads(threads)  # OpenMP's thread count is per calling thread
        batch.go.wait()
        batch.go.clear()
        state = "aborted"
        try:
            if abort[0]:
                raise _Abort
            with torch.no_grad():  # grad mode is per thread
                out = layer(batch.hidden, **kwargs[batch.index])
            batch.output = out[0] if isinstance(out, tuple) else out
            state = "done"
        except _Abort:
            pass
        except BaseException as exc:  # handed to the caller's thread, raised there
            batch.error, state = exc, "failed"
        finally:
            batch.hidden = None
            hand_back(batch, state)
            _Worker.finished()
            batch.ended.set()

    def run(ready: Iterable[_Batch]) -> None:
        """Let these batches run (at most `parallel` at once) until each has parked or ended."""
        for b in ready:
            with cv:
                while running[0] >= parallel:
                    cv.wait()
                running[0] += 1
                b.state = "running"
            b.go.set()
        with cv:
            while running[0] > 0:
                cv.wait()
        failed = next((b for b in batches if b.state == "failed"), None)
        if failed is not None:
            raise failed.error

    handles = [m.register_forward_pre_hook(park) for group in groups for m in group]
    batches: list[_Batch] = []
    emitted = 0

    def flush(emitted: int) -> int:
        """Finished batches' outputs, in order, as soon as every earlier batch has finished; how many are out."""
        while outputs is not None and emitted < len(batches) and batches[emitted].state == "done":
            outputs.append(batches[emitted].output)
            batches[emitted].output = None
            emitted += 1
        return emitted

    def fresh() -> Iterable[_Batch]:
        for i, h in enumerate(hidden):  # read (a spilled batch: from disk) only when its turn comes
            batch = _Batch(i, threading.Event(), hidden=h)
            batches.append(batch)
            _Worker.run(lambda b=batch: work(b))
            del h
            yield batch

    try:
        run(fresh())
        while True:
            parked = [b for b in batches if b.state == "parked"]
            if not parked:
                break
            g = min(b.group for b in parked)
            waiting = [b for b in parked if b.group == g]
            for b in waiting:  # in batch order, from this thread: the same sums whatever ran first
                x, b.pending = b.pending, None
                on_input(g, x)
                del x
            at_group(g)
            done.add(g)
            run(waiting)
            emitted = flush(emitted)
        flush(emitted)
        missing = [g for g in range(len(groups)) if g not in done]
        if batches and missing:
            raise QuantizationError(f"no calibration batch reached {label(missing[0])} in this layer's forward")
    finally:
        with cv:
            abort[0] = True
            stopped = [b for b in batches if b.state in ("parked", "new")]
        for b in stopped:
            b.go.set()  # it sees the abort and unwinds
        for b in batches:
            b.ended.wait()
        for handle in handles:
            handle.remove()
    return outputs


def _lanes(groups: Sequence[Sequence[nn.Module]], hidden: Iterable[torch.Tensor]) -> tuple[int, int]:
    """(batches computing at once, intra-op threads each). On a CPU one batch per intra-op thread (no more
    than there are batches): several multi-threaded OpenMP teams alive at once make every team sleep between
    parallel regions, and GPTQ's per-column solver steps, run by the caller between stops, were then 5x
    slower. On an accelerator one batch at a time, on the caller's threads."""
    threads = torch.get_num_threads()
    first = next((m for group in groups for m in group), None)
    weight = getattr(first, "weight", None)
    if weight is not None and weight.device.type != "cpu":
        return 1, threads
    batches = len(hidden) if hasattr(hidden, "__len__") else threads
    parallel = max(1, min(threads, batches))
    return parallel, max(1, threads // parallel)
