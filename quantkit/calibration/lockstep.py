"""One decoder layer run over every calibration batch in lock step, every batch paused at each linear group.

True-sequential quantization calibrates each group of linears that read one input (q/k/v, o, gate/up,
down) on what the layer computes with the groups before it already quantized, over all the
batches, before that group's own weights change. Its textbook form runs the layer once per group
(GPTQModel's and AutoGPTQ's `true_sequential`); a single forward does the same if every batch can
stop at a group until all the others have reached it, and a module's forward cannot pause. So here
each batch's forward runs in a greenlet of its own (a stack that can stop and resume, on the caller's
thread), and a pre-hook on each group's linears parks the batch there, switching back to the caller.
When every batch is parked or finished, the earliest group waited on is handed to `at_group`, its
batches go on, one after another, and so on: one forward per layer gives each group the same inputs
as the textbook form, in the same batch order, and the layer's quantized outputs.

Why greenlets rather than threads: everything runs on the caller's thread, so every batch's forward and
every solve between them use the process's one OpenMP team at its full width. A thread per batch
(the first form) gave each worker thread an OpenMP team of its own, and while more OpenMP threads are
alive than there are cores, libgomp stops spinning between parallel regions: GPTQ's small per-column
steps, run between the stops, were then 2-6x slower (measured: a 1536 x 64 `addr_` 14 us alone, 65 us
with a parked worker's team alive), and a small calibration took ~1.4x the time of the two-pass form.

Memory: every batch's forward is in flight at once, so each holds its intermediate tensors (about
the residual, the group input and an MLP intermediate per token) until the pass ends.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import greenlet
import torch
from torch import nn

from quantkit.calibration.driver import call_layer
from quantkit.errors import QuantizationError


class _Abort(BaseException):
    """Unwinds a parked batch's forward when the pass is abandoned (another batch failed, an interrupt)."""


_live = [0]  # batch forwards begun and not yet ended, over every pass


def live_batches() -> int:
    """How many lock-step batch forwards are begun and not ended (0 once every pass has ended)."""
    return _live[0]


@dataclass
class _Batch:
    index: int
    hidden: Optional[torch.Tensor] = None
    state: str = "new"  # new -> running -> parked / done
    group: int = -1  # the group it is parked at
    pending: Optional[torch.Tensor] = None  # its input to that group, observed when the group's turn comes
    output: Any = None
    seen: set = field(default_factory=set)  # the groups this batch has reached
    forward: Optional[greenlet.greenlet] = None


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
) -> Optional[list]:
    """Run `layer` on every (hidden, kwargs) batch, pausing all of them before each group of `groups`.

    on_input(g, x): a batch's input `x` to group g (its linears share it), before the group is quantized;
    called batch by batch in order, once every batch has reached g.
    at_group(g): every batch has given its input to group g (or finished without reaching it): quantize
    it now; the batches then run on with its new weights. outputs: a list (or an `Activations`) the layer's
    outputs are appended to in batch order, and returned. names: each group's name, for errors.
    Batches compute one at a time, each on all the intra-op threads; the callbacks run between them, on
    the caller's thread and outside every batch's forward. An exception in a batch's forward or in a
    callback ends the pass: every parked forward is unwound first.
    A batch that reaches a group after it was quantized (the layer calls its linears in an order that
    differs between batches) is an error, never statistics missing a batch.
    """
    run = _Pass(layer, list(kwargs), groups, outputs, names)
    handles = [m.register_forward_pre_hook(run.park) for group in groups for m in group]
    try:
        for i, h in enumerate(hidden):  # read (a spilled batch: from disk) only when its turn comes
            run.start(_Batch(i, hidden=h))
            del h
        run.serve(on_input, at_group)
    finally:
        run.unwind()
        for handle in handles:
            handle.remove()
    return outputs


class _Pass:
    """One lock-step pass: the batches, which group each is parked at, and the caller they switch back to."""

    def __init__(self, layer: nn.Module, kwargs: list[dict], groups: Sequence[Sequence[nn.Module]],
                 outputs: Optional[list], names: Optional[Sequence[str]]):
        self.layer, self.kwargs, self.groups, self.outputs, self.names = layer, kwargs, groups, outputs, names
        self.where = {id(m): g for g, group in enumerate(groups) for m in group}
        self.done: set[int] = set()
        self.caller = greenlet.getcurrent()
        self.current: Optional[_Batch] = None  # the batch whose forward is running
        self.batches: list[_Batch] = []
        self.emitted = 0  # outputs handed out, in batch order

    def label(self, g: int) -> str:
        return self.names[g] if self.names else f"group {g}"

    def park(self, module: nn.Module, args: tuple) -> None:
        """The pre-hook on every group's linears: the running batch stops here until the group's turn."""
        batch = self.current
        if batch is None:
            return  # the layer run outside this pass's batches (a callback's own forward)
        g = self.where[id(module)]
        if g in batch.seen:
            return  # this batch gave the group its input at the group's first linear; the rest read the same
        if g in self.done:
            raise QuantizationError(
                f"calibration batch {batch.index} reached {self.label(g)} after it was quantized: this layer calls "
                "its linears in an order that differs between batches, which a single true-sequential pass cannot "
                "follow; set true_sequential: false for this stage")
        batch.seen.add(g)
        batch.group, batch.pending, batch.state = g, args[0], "parked"
        self.caller.switch()  # back to the pass; resumed (or unwound by _Abort) when the group's turn is over

    def _work(self, batch: _Batch) -> None:
        _live[0] += 1
        try:
            batch.output = call_layer(self.layer, batch.hidden, self.kwargs[batch.index])
            batch.state = "done"
        finally:
            batch.hidden = None
            _live[0] -= 1

    def start(self, batch: _Batch) -> None:
        self.batches.append(batch)
        forward = greenlet.greenlet(self._work, parent=self.caller)
        forward.gr_context = contextvars.copy_context()  # the forward sees the caller's context variables
        batch.forward = forward
        self.resume(batch, batch)

    def resume(self, batch: _Batch, *args: Any, throw: bool = False) -> None:
        """Run the batch's forward until it parks or ends; what it raises is raised here."""
        self.current, batch.state = batch, "running"
        try:
            if throw:
                batch.forward.throw(_Abort)
            else:
                batch.forward.switch(*args)
        finally:
            self.current = None

    def serve(self, on_input: Callable[[int, torch.Tensor], None], at_group: Callable[[int], None]) -> None:
        """Hand the earliest group waited on its inputs and its turn, until no batch is parked."""
        while True:
            parked = [b for b in self.batches if b.state == "parked"]
            if not parked:
                break
            g = min(b.group for b in parked)
            waiting = [b for b in parked if b.group == g]
            for b in waiting:  # in batch order: the same sums whatever the batches' sizes
                x, b.pending = b.pending, None
                on_input(g, x)
                del x
            at_group(g)
            self.done.add(g)
            for b in waiting:
                self.resume(b)
            self._flush()
        self._flush()
        missing = [g for g in range(len(self.groups)) if g not in self.done]
        if self.batches and missing:
            raise QuantizationError(f"no calibration batch reached {self.label(missing[0])} in this layer's forward")

    def _flush(self) -> None:
        """Finished batches' outputs, in order, as soon as every earlier batch has finished."""
        while self.outputs is not None and self.emitted < len(self.batches) \
                and self.batches[self.emitted].state == "done":
            self.outputs.append(self.batches[self.emitted].output)
            self.batches[self.emitted].output = None
            self.emitted += 1

    def unwind(self) -> None:
        """Drop what the batches hold; unwind every parked forward (its frames' finally blocks run)."""
        for b in self.batches:
            b.pending = b.output = None
            if b.state == "parked" and not b.forward.dead:
                try:
                    self.resume(b, throw=True)
                except _Abort:
                    pass
