"""The engine's run-time state: execution order, reductions in flight, the end of backward.

[Note: one step]
Forward: each block links itself after the block that ran before it (the first time), prefetches
the block linked after it, gathers its own group and runs. Backward: a block's pre-backward
hook prefetches the block recorded before it; when its parameters' gradients are ready they are
reduce-scattered asynchronously, and the oldest reductions beyond ``MAX_PENDING`` are waited for
(so at most that many full-size gradient buffers live at once). A callback queued on the
autograd engine runs when the whole backward is done: it waits for every reduction, releases
whatever is still gathered.

The order only steers prefetching. A step that runs the blocks in another order, skips some, or
runs one twice still computes the right result: a block that was not prefetched is gathered when
it runs, and a prefetched block that does not run is released at the end of the step.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Protocol, Tuple

import torch
from torch.autograd import Variable

from .dist import DistContext, current
from .group import FlatBuffer, ParamGroup, ParamRegistry, PendingReduction

__all__ = ["Engine", "ExecutionOrder", "Linked", "Participant", "engine"]

# Reduce-scatters in flight before the oldest is waited for: one overlapping the next block's
# backward, one more of slack.
MAX_PENDING = 2


class Participant(Protocol):
    """A block or root that takes part in a step."""

    group: ParamGroup

    def backward_done(self) -> None: ...


class Linked(Participant, Protocol):
    """A block, linked to its neighbours in the order it first ran."""

    next_block: Optional["Linked"]
    prev_block: Optional["Linked"]


class ExecutionOrder:
    """Learns "who runs next / ran before" from the order blocks first run in.

    The links live on the blocks themselves and are set once, the first time a block follows
    another; a model built later learns its own order in its first forward.
    """

    def __init__(self) -> None:
        self._last: Optional[Linked] = None
        self.first: Optional[Linked] = None  # the block that first ran first in a forward
        self.known = False  # a whole step (forward and backward) has been seen

    def record(self, block: Linked) -> None:
        last = self._last
        if last is None and self.first is None:
            self.first = block
        if last is not None and last is not block:
            if last.next_block is None:
                last.next_block = block
            if block.prev_block is None:
                block.prev_block = last
        self._last = block

    def restart(self) -> None:
        """A new forward begins: the next block recorded has no predecessor."""
        self._last = None


class Engine:
    """Per-process engine state, reached through :func:`engine`."""

    def __init__(self, ctx: DistContext) -> None:
        self.ctx = ctx
        self.registry = ParamRegistry()
        self.order = ExecutionOrder()
        self.active_root: Optional[Participant] = None
        self.block_depth = 0  # > 0 while a block's module runs
        self.blocks_built = 0  # numbers block names, for messages and traces
        self.wrapped: Dict[int, Any] = {}  # id(model) -> what bmtwrap.wrap made of it (wrap.convert.Wrapped)
        # Reductions in flight, each with whether it is the buffer's last in this backward.
        self._pending: List[Tuple[PendingReduction, bool]] = []
        # Told of each buffer whose gradient is final for this backward (an optimizer stepping in
        # backward); weak, so that a discarded optimizer drops out.
        self._grad_listeners: List["weakref.WeakMethod[Callable[[FlatBuffer], None]]"] = []
        self._in_backward: List[Participant] = []  # participants that ran forward with grad
        self._callback_task = -1  # the autograd graph task our end-of-backward callback is queued on
        # Offloaded buffers whose gradients this backward copies to the host (see [Note: offloaded shards]).
        self._host_grads: Dict[int, FlatBuffer] = {}

    # --- forward ---------------------------------------------------------------------------------
    def forward_with_grad(self, participant: Participant) -> None:
        """``participant`` ran forward with autograd recording; it takes part in the next backward."""
        if not any(p is participant for p in self._in_backward):
            self._in_backward.append(participant)

    # --- backward --------------------------------------------------------------------------------
    def backward_started(self) -> None:
        """Called by every backward hook; queues the end-of-backward callback once per pass.

        Keyed by the graph task, so a backward that raised (and never ran its callback) does not
        stop the next one from queueing its own.
        """
        task = torch._C._current_graph_task_id()
        if task != self._callback_task:
            Variable._execution_engine.queue_callback(self._backward_finished)
            self._callback_task = task

    def add_reductions(self, pending: List[PendingReduction], *, final: bool = False) -> None:
        """Reductions just issued; ``final``: no more gradient reaches these buffers in this backward."""
        self.backward_started()
        self._pending.extend((reduction, final) for reduction in pending)
        while len(self._pending) > MAX_PENDING:
            self._finish_oldest()

    def finish_reductions(self) -> None:
        while self._pending:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        reduction, final = self._pending.pop(0)
        reduction.finish()
        if reduction.buffer.offloaded:
            self._host_grads[id(reduction.buffer)] = reduction.buffer
        if final:
            for listener in list(self._grad_listeners):
                method = listener()
                if method is None:
                    self._grad_listeners.remove(listener)
                else:
                    method(reduction.buffer)

    def listen_for_final_grads(self, method: Callable[[FlatBuffer], None]) -> None:
        """Call the bound ``method(buffer)`` whenever a buffer's gradient shard is final for this backward.

        Final means the block ran as many backward passes as it ran forwards since the last
        step; the root group's buffers are never reported (their gradients complete only when
        the whole backward does).
        """
        self._grad_listeners.append(weakref.WeakMethod(method))

    @contextlib.contextmanager
    def roots_shown(self) -> Iterator[None]:
        """Roots that ran forward with grad show their full parameters (see RootRunner.show_for_recompute)."""
        shown = [p for p in self._in_backward if getattr(p, "show_for_recompute", None) and p.show_for_recompute()]
        try:
            yield
        finally:
            for participant in shown:
                participant.hide()

    def recover_if_stale(self) -> None:
        """A new forward starts while a backward never finished (it raised, and the caller went on).

        Its reductions are waited for and dropped (the caller has zeroed or will zero the
        gradients; adding them later would corrupt the next step) and its participants released.
        """
        if self._callback_task == -1 or torch._C._current_graph_task_id() != -1:
            return
        pending, self._pending = self._pending, []
        for reduction, _ in pending:
            reduction.discard()
        self._wait_host_grads()
        participants, self._in_backward = self._in_backward, []
        for participant in participants:
            participant.backward_done()
        self._callback_task = -1
        self.order.restart()

    def _backward_finished(self) -> None:
        self._callback_task = -1
        self.finish_reductions()
        self._wait_host_grads()
        participants, self._in_backward = self._in_backward, []
        for participant in participants:
            participant.backward_done()
        self.order.restart()
        self.order.known = True

    def _wait_host_grads(self) -> None:
        """Gradients of offloaded buffers are read on the host after backward: wait for their copies."""
        buffers, self._host_grads = self._host_grads, {}
        for buffer in buffers.values():
            buffer.wait_grads()


def engine(ctx: Optional[DistContext] = None) -> Engine:
    """The engine of this process's context (created on first use)."""
    ctx = ctx or current()
    if ctx.engine is None:
        ctx.engine = Engine(ctx)
    return ctx.engine
