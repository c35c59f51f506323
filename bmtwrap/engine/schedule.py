"""The collective schedule and the engine's run-time state: execution order, prefetch, reductions in flight.

[Note: one step]
Forward: each block links itself after the block that ran before it (the first time), asks the
:class:`Schedule` what to gather (its own group, then the block linked after it), and runs.
Backward: a block's pre-backward hook asks again (its own group, then the block recorded before
it); when its parameters' gradients are ready they are reduce-scattered asynchronously, and the
oldest reductions beyond ``MAX_PENDING`` are waited for (so at most that many full-size gradient
buffers live at once). A callback queued on the autograd engine runs when the whole backward is
done: it waits for every reduction, releases whatever is still gathered.

The order only steers prefetching. A step that runs the blocks in another order, skips some, or
runs one twice still computes the right result: a block that was not prefetched is gathered when
it runs, and a prefetched block that does not run is released at the end of the step.

[Note: the prefetch policy]
Every gather the engine issues ahead of need is decided here, in :class:`Schedule`:
- a root entering a forward: its own group, then the block that first ran first (in flight
  together with the root's gather);
- a block starting its forward: its own group, then the block linked after it;
- a block's pre-backward: its own group, then the block linked before it;
- under ZeRO-3 the block that runs last in forward keeps its parameters until its backward,
  which comes first: releasing and gathering them again would only expose a gather.
So at most the running block's and one neighbour's groups are being gathered at a time. The
runners (:mod:`bmtwrap.engine.runners`) issue what the schedule returns, in the order returned.
"""

from __future__ import annotations

import contextlib
import enum
import types
import weakref
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Mapping, Optional, Protocol, Tuple

import torch
from torch import nn
from torch.autograd import Variable
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .dist import DistContext, current
from .group import FlatBuffer, ParamGroup, ParamRegistry, PendingReduction
from .memory import out_of_memory_advice
from .on_demand import OnDemandGathers
from .watchdog import CollectiveError

__all__ = ["Engine", "ExecutionOrder", "Linked", "Participant", "Schedule", "TrainingState", "WrapRecord", "engine",
           "in_backward"]

# Reduce-scatters in flight before the oldest is waited for: one overlapping the next block's
# backward, one more of slack.
MAX_PENDING = 2
# The attribute of a wrapped model that holds what bmtwrap.wrap made of it (the engine refers to it weakly).
RECORD_ATTRIBUTE = "_bmtwrap_wrapped"


def _graph_task() -> int:
    """The id of the autograd graph task this thread is running; -1 outside backward."""
    return torch._C._current_graph_task_id()


def in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread (a block's forward is then a recomputation)."""
    return _graph_task() != -1


class TrainingState(enum.Enum):
    """Where this process is in a training step (see :attr:`Engine.state`)."""

    IDLE = "idle"  # no forward of ours runs and no backward is under way
    FORWARD = "forward"  # a root entered its forward, or a block's module runs (a recomputation in backward too)
    BACKWARD = "backward"  # a backward reached our hooks; its end-of-backward callback has not run yet


class Participant(Protocol):
    """A block or root that takes part in a step."""

    group: ParamGroup

    def backward_done(self) -> None: ...


class Linked(Participant, Protocol):
    """A block, linked to its neighbours in the order it first ran."""

    next_block: Optional["Linked"]
    prev_block: Optional["Linked"]

    def lend(self) -> None:
        """Its group is gathered for code outside it in this forward (see on_demand.py)."""

    def take_back(self) -> None:
        """The forward without autograd that lent its group has ended."""


class WrapRecord(Protocol):
    """What :func:`bmtwrap.wrap` made of one model, as the engine keeps it (``wrap.convert.Wrapped``)."""

    model: "weakref.ref[nn.Module]"

    def dissolve(self) -> None:
        """Undo the wrapping: every parameter full again, the model's hooks and block forwards removed."""
        ...


class ExecutionOrder:
    """Learns "who runs next / ran before" from the order blocks first run in.

    The links live on the blocks themselves and are set once, the first time a block follows
    another; a model built later learns its own order in its first forward.
    """

    def __init__(self) -> None:
        # Weak, as the engine's other references to a model's parts: a forward that no backward follows (evaluation,
        # generation) leaves them set, and must not keep a model the program dropped alive.
        self._last: Optional["weakref.ref[Linked]"] = None
        self._root: Optional["weakref.ref[Participant]"] = None  # the running forward's root; None: blocks alone
        # The block that first ran first in a forward of each root (models do not share their first block).
        self._firsts: "weakref.WeakKeyDictionary[Participant, Linked]" = weakref.WeakKeyDictionary()
        self.known = False  # a whole step (forward and backward) has been seen

    def first_of(self, root: Participant) -> Optional[Linked]:
        return self._firsts.get(root)  # the block that first ran first in root's forward, if one did

    def record(self, block: Linked) -> None:
        last = self._last() if self._last is not None else None
        root = self._root() if self._root is not None else None
        if last is None and root is not None and root not in self._firsts:
            self._firsts[root] = block
        if last is not None and last is not block:  # the first links stay
            last.next_block = block if last.next_block is None else last.next_block
            block.prev_block = last if block.prev_block is None else block.prev_block
        self._last = weakref.ref(block)

    def restart(self, root: Optional[Participant] = None) -> None:
        """A new forward begins (``root``'s, or blocks run alone): the next block recorded has no predecessor."""
        self._last = None
        self._root = None if root is None else weakref.ref(root)

    def step_seen(self) -> None:
        """A whole step ended (its backward finished): restart, and the links are now known."""
        self.restart()
        self.known = True


class Schedule:
    """When each collective is issued: the order blocks run in, what to gather at each point of a
    step, and how many reductions may be in flight (see [Note: the prefetch policy]).

    The runners ask it and issue what it returns; none decides on its own, so another schedule
    is a change of this class alone.
    """

    def __init__(self) -> None:
        self.order = ExecutionOrder()
        self.max_pending_reductions = MAX_PENDING

    def root_gathers(self, root: Participant) -> List[ParamGroup]:
        """A root enters a forward: its own group, then the block that first ran first."""
        first = self.order.first_of(root)
        return [root.group] if first is None else [root.group, first.group]

    def forward_gathers(self, block: Linked) -> List[ParamGroup]:
        """``block`` starts its forward: its own group, then the block linked after it."""
        return self._with_neighbour(block, block.next_block)

    def backward_gathers(self, block: Linked) -> List[ParamGroup]:
        """``block``'s backward is about to run: its own group, then the block linked before it."""
        return self._with_neighbour(block, block.prev_block)

    def runs_last(self, block: Linked) -> bool:
        """Whether ``block`` ran last in the forwards seen, so that its backward runs first (known after a step)."""
        return self.order.known and block.next_block is None

    @staticmethod
    def _with_neighbour(block: Linked, neighbour: Optional[Linked]) -> List[ParamGroup]:
        return [block.group] if neighbour is None or neighbour is block else [block.group, neighbour.group]


class Engine:
    """Per-process engine state, reached through :func:`engine`.

    Other modules change it through its methods only: :meth:`enter_root`/:meth:`leave_root`,
    :meth:`enter_block`/:meth:`leave_block`, :meth:`forward_with_grad`, :meth:`backward_started`,
    :meth:`add_reductions`, :meth:`register_wrapped`, :meth:`next_block_number`.
    """

    def __init__(self, ctx: DistContext) -> None:
        self.ctx = ctx
        self.registry = ParamRegistry()
        self.schedule = Schedule()
        # Roots whose forward is running, outermost first: a model's root, then the roots of
        # separately wrapped models it calls (see RootRunner.enter).
        self._active_roots: List[Participant] = []
        self._block_depth = 0  # > 0 while a block's module runs
        self._blocks_built = 0  # numbers block names, for messages and traces
        # id(model) -> what bmtwrap.wrap made of it: the model holds its record, the engine only refers to it.
        self._wrapped: Dict[int, "weakref.ref[WrapRecord]"] = {}
        # The module each block runs -> its runner: a Block or a block wrap made (see block_runner_of).
        # Weak both ways: a model nobody uses any more is freed (a runner refers to its module's parameters).
        self._block_runners: Dict[int, Tuple["weakref.ref[nn.Module]", "weakref.ref[Linked]"]] = {}
        self._runner_of_group: Dict[int, "weakref.ref[Linked]"] = {}  # id(group) -> the block runner that gathers it
        # The mode of the forward running under the outermost root (see on_demand.py), if any.
        self._on_demand: Optional[OnDemandGathers] = None
        # Reductions in flight, each with whether it is the buffer's last in this backward.
        self._pending: List[Tuple[PendingReduction, bool]] = []
        # Told of each buffer whose gradient is final for this backward (an optimizer stepping in
        # backward); weak, so that a discarded optimizer drops out.
        self._grad_listeners: List["weakref.WeakMethod[Callable[[FlatBuffer], None]]"] = []
        # Participants that ran forward with grad, weakly: a forward whose backward never comes (its output dropped)
        # must not keep a model the program dropped alive.
        self._in_backward: List["weakref.ref[Participant]"] = []
        self._callback_task = -1  # the autograd graph task our end-of-backward callback is queued on
        self._inner = 0  # > 0 while backward passes run inside another (see inner_backward)
        # Offloaded buffers whose gradients this backward copies to the host (see [Note: offloaded shards]).
        self._host_grads: Dict[int, FlatBuffer] = {}
        self._step_hook: Optional[Any] = None  # the handle of install_step_check's hook
        self.optimizer_steps = 0  # optimizer steps taken in this process, once a step listener asked to count them
        self._step_counter: Optional[Any] = None
        # GPU memory for the automatic choices (see [Note: who gets the GPU memory left] in engine/placement.py).
        self._gpu_claims: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
        self.max_gpu_memory: Optional[int] = None  # the budget wrap(max_gpu_memory=...) set, in bytes
        self.allocator_cap: Optional[int] = None  # what memory.cap_allocator holds torch's allocator to, under it
        self.passes_done = 0  # backward passes finished: the step running is number passes_done + 1
        # Told when a forward with autograd starts (outermost root) and when a backward ends (weak).
        self._step_listeners: List[Tuple[Any, ...]] = []  # (root, forward_starts, backward_ends), all weak
        # Told when any model's outermost forward starts, with or without autograd (weak).
        self._forward_listeners: List["weakref.WeakMethod[Callable[[bool], None]]"] = []
        # Optimizers whose state may live in host memory (see offload_optimizers).
        self._offloaders: "weakref.WeakSet[Any]" = weakref.WeakSet()

    def claim_gpu_memory(self, owner: Any, nbytes: int) -> None:
        """``owner`` (an optimizer with ``offload_fraction="auto"``) would use up to ``nbytes`` of the GPU
        memory training leaves free; ``checkpoint="auto"`` keeps activations only in what remains.
        See [Note: who gets the GPU memory left] in ``bmtwrap/engine/placement.py``.
        """
        self._gpu_claims.pop(owner, None)
        if nbytes > 0:
            self._gpu_claims[owner] = nbytes

    def gpu_claims(self) -> int:
        """The bytes claimed with :meth:`claim_gpu_memory` by live owners."""
        return sum(self._gpu_claims.values())

    def listen_for_steps(self, root: Participant, forward_starts: Callable[[], None],
                         backward_ends: Callable[[], None]) -> None:
        """Call the bound methods ``forward_starts()`` when a forward with autograd of ``root``'s model starts (as
        the outermost root, before it gathers anything) and ``backward_ends()`` when a backward pass through it has
        finished. Held weakly, as is ``root``."""
        self._step_listeners.append((weakref.ref(root), weakref.WeakMethod(forward_starts),
                                     weakref.WeakMethod(backward_ends)))
        if self._step_counter is None:  # counts the steps of every torch optimizer (bmtwrap's too): optimizer_steps
            self._step_counter = register_optimizer_step_post_hook(self._count_optimizer_step)

    def listen_for_forward_starts(self, method: Callable[[bool], None]) -> None:
        """Call the bound ``method(with_grad)`` whenever the outermost forward of any wrapped model or block starts,
        before it gathers anything; ``with_grad``: autograd records it. Held weakly."""
        self._forward_listeners.append(weakref.WeakMethod(method))

    def add_offload_optimizer(self, optimizer: Any) -> None:
        """Remember ``optimizer`` (held weakly): its ``offload_fraction`` is the share of its state in host memory,
        and ``handed(param)`` what it took off ``param.grad`` in this step's backward (readers of gradients ask)."""
        self._offloaders.add(optimizer)

    def offload_optimizers(self) -> List[Any]:
        """The live optimizers given to :meth:`add_offload_optimizer`."""
        return list(self._offloaders)

    def _count_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.optimizer_steps += 1

    def _tell(self, which: int, roots: List[Participant]) -> None:
        for listener in list(self._step_listeners):
            root, method = listener[0](), listener[which]()
            if root is None or method is None:
                self._step_listeners.remove(listener)
            elif any(r is root for r in roots):
                method()

    def step_failed(self, error: BaseException, where: str) -> None:
        """``error`` escapes the engine's part of a step at ``where`` (``"the forward of block 'layers.3'"``):
        add a note naming this rank, the step and, for running out of memory, the memory and what to change;
        tell the watchdog, so that the other ranks stop instead of waiting for this one (see [Note: a failed
        step])."""
        if (getattr(error, "_bmtwrap_step", None) is not None or not isinstance(error, Exception)
                or isinstance(error, CollectiveError)):  # that one names the operation and the ranks already
            return
        step = self.passes_done + 1
        try:
            error._bmtwrap_step = step  # type: ignore[attr-defined]
        except AttributeError:  # an exception type without a __dict__
            return
        what = f"{type(error).__name__} in {where}"
        note = f"bmtwrap: raised on rank {self.ctx.rank} of {self.ctx.world_size} in step {step}, in {where}."
        if isinstance(error, torch.OutOfMemoryError):
            runners = [r for r in self._live_block_runners() if not r.group.dissolved]
            advice = out_of_memory_advice(self.ctx.device, all(getattr(r, "recompute", True) for r in runners))
            what += ". " + advice
            note += " " + advice
        if hasattr(error, "add_note"):
            error.add_note(note)
        elif error.args and isinstance(error.args[0], str):  # Python 3.10
            error.args = (f"{error.args[0]}\n{note}",) + error.args[1:]
        if self.ctx.watchdog is not None:
            self.ctx.watchdog.step_failed(step, what)

    def install_step_check(self, check: Callable[[torch.optim.Optimizer, Any, Any], None]) -> None:
        """Run ``check`` before every optimizer step of this process (registered once, however often asked)."""
        if self._step_hook is None:
            self._step_hook = register_optimizer_step_pre_hook(check)

    @property
    def state(self) -> TrainingState:
        """Where this process is in a step.

        Derived, not stored: forward and backward overlap (a checkpointed block recomputes its
        forward inside backward), so FORWARD, which a running root or block means, comes first.
        """
        if self._active_roots or self._block_depth > 0:
            return TrainingState.FORWARD
        if self._callback_task != -1:
            return TrainingState.BACKWARD
        return TrainingState.IDLE

    def root_running(self, root: Participant) -> bool:
        """Whether ``root``'s forward is running (it entered and has not left)."""
        return any(active is root for active in self._active_roots)

    def may_enter_root(self, root: Participant) -> bool:
        """Whether ``root`` should gather its group for a forward starting now.

        Not inside a block (a block gathers what it runs), and not while a running root already
        holds any of its buffers (a hand-written model's root covers the lone parameters of the
        modules inside it, and a root is entered once however often its entry points nest).
        """
        if self._block_depth > 0:
            return False
        buffers = {id(buffer) for buffer in root.group.buffers}
        return not any(buffers.intersection(id(b) for b in active.group.buffers) or active is root
                       for active in self._active_roots)

    # --- forward ---------------------------------------------------------------------------------
    def enter_root(self, root: Participant) -> bool:
        """→ FORWARD: ``root`` starts a forward. Returns whether it is the outermost one, whose forward
        begins a new execution order (a root entered inside it belongs to a model it calls)."""
        assert self.may_enter_root(root), f"rank {self.ctx.rank}: a root entered where it may not"
        outermost = not self._active_roots
        if outermost and self._block_depth == 0:
            self._forward_starts()
        if outermost and torch.is_grad_enabled():
            self._tell(1, [root])
        if outermost:
            self.schedule.order.restart(root)
            self._on_demand = OnDemandGathers(self.registry, lambda buffer: buffer.group, self._lend)
            self._on_demand.__enter__()
        self._active_roots.append(root)
        return outermost

    def leave_root(self, root: Participant) -> None:
        """The forward ``root`` entered has returned."""
        assert self._active_roots and self._active_roots[-1] is root, (
            f"rank {self.ctx.rank}: a root left a forward it did not enter last"
        )
        self._active_roots.pop()
        if not self._active_roots and self._on_demand is not None:
            mode, self._on_demand = self._on_demand, None
            mode.end()
            for group, with_grad in mode.lent.values():
                if not with_grad:  # lent only without autograd: no backward will give it back
                    runner = self._runner_for(group)
                    if runner is not None:
                        runner.take_back()

    def enter_block(self) -> None:
        """A block's module starts running (FORWARD until the matching :meth:`leave_block`)."""
        if not self._active_roots and self._block_depth == 0 and not in_backward():
            self._forward_starts()  # a block called from the program itself (BMTrain's models have no root)
        self._block_depth += 1

    def _forward_starts(self) -> None:
        _call_weak(self._forward_listeners, torch.is_grad_enabled())

    def leave_block(self) -> None:
        assert self._block_depth > 0, f"rank {self.ctx.rank}: a block left more often than blocks entered"
        self._block_depth -= 1

    def forward_with_grad(self, participant: Participant) -> None:
        """``participant`` ran forward with autograd recording; it takes part in the next backward."""
        if not any(ref() is participant for ref in self._in_backward):
            self._in_backward.append(weakref.ref(participant))

    def _backward_participants(self) -> List[Participant]:  # live, ran forward with grad since the last backward
        return [p for p in (ref() for ref in self._in_backward) if p is not None]

    def _take_backward_participants(self) -> List[Participant]:
        participants, self._in_backward = self._backward_participants(), []
        return participants

    def register_block(self, module: nn.Module, runner: Linked) -> None:
        """``runner`` runs ``module`` as a block from now on."""
        self._block_runners = {k: (m, r) for k, (m, r) in self._block_runners.items()
                               if m() is not None and r() is not None}
        self._block_runners[id(module)] = (weakref.ref(module), weakref.ref(runner))
        self._runner_of_group = {k: v for k, v in self._runner_of_group.items() if v() is not None}
        self._runner_of_group[id(runner.group)] = weakref.ref(runner)

    def _live_block_runners(self) -> List[Linked]:
        pairs = [(module(), runner()) for module, runner in list(self._block_runners.values())]
        return [runner for module, runner in pairs if module is not None and runner is not None]

    def _runner_for(self, group: ParamGroup) -> Optional[Linked]:
        """The block runner that gathers ``group``, if it is alive."""
        ref = self._runner_of_group.get(id(group))
        runner = None if ref is None else ref()
        return runner if runner is not None and runner.group is group else None

    def engine_work(self) -> ContextManager[None]:
        """The engine's own code runs: the forward's on-demand mode lets sharded parameters pass as they are."""
        mode = self._on_demand
        return contextlib.nullcontext() if mode is None else mode.engine_code()

    def user_code(self) -> ContextManager[None]:
        """The model's own code runs (inside :meth:`engine_work`): the on-demand mode watches again."""
        mode = self._on_demand
        return contextlib.nullcontext() if mode is None else mode.model_code()

    def _lend(self, group: ParamGroup) -> bool:
        runner = self._runner_for(group)
        if runner is None:
            return False
        runner.lend()
        return True

    def block_runner_of(self, module: nn.Module) -> Optional[Linked]:
        """The runner of the block that runs ``module``, if one does (its group owns the module's parameters)."""
        module_ref, runner_ref = self._block_runners.get(id(module), (None, None))
        if module_ref is None or module_ref() is not module:
            return None
        runner = runner_ref()
        return runner if runner is not None and not runner.group.dissolved else None

    def next_block_number(self) -> int:
        """A new number for a block's name (0, 1, 2, ... in the order blocks are built)."""
        self._blocks_built += 1
        return self._blocks_built - 1

    # --- models wrapped by bmtwrap.wrap ----------------------------------------------------------
    def register_wrapped(self, model: nn.Module, record: WrapRecord) -> None:
        """Remember what :func:`bmtwrap.wrap` made of ``model`` (so that wrapping again is detected)."""
        assert record.model() is model, f"rank {self.ctx.rank}: a wrap record of another model"
        # The model keeps the record (the runners, the GPU memory) alive, nothing else does: a model dropped is freed.
        object.__setattr__(model, RECORD_ATTRIBUTE, record)
        self._wrapped = {k: ref for k, ref in self._wrapped.items() if ref() is not None}
        self._wrapped[id(model)] = weakref.ref(record)

    def wrapped_record(self, model: nn.Module) -> Optional[WrapRecord]:
        """What :func:`bmtwrap.wrap` made of ``model``; ``None`` if it did not wrap this very object."""
        ref = self._wrapped.get(id(model))
        record = None if ref is None else ref()
        return record if record is not None and record.model() is model else None

    def dissolve_wrapped_under(self, module: nn.Module, *, keep: Optional[nn.Module] = None) -> None:
        """Undo :func:`bmtwrap.wrap` for every wrapped model inside ``module`` (``module`` itself included,
        ``keep`` excepted), so that an enclosing block or wrap shards those parameters itself.

        A collective: every rank must build the same enclosing block.
        """
        inside = {id(m) for m in module.modules()}
        for key, ref in list(self._wrapped.items()):
            record = ref()
            model = None if record is None else record.model()
            if model is None:
                del self._wrapped[key]
            elif id(model) in inside and model is not keep:
                record.dissolve()
                del self._wrapped[key]
                model.__dict__.pop(RECORD_ATTRIBUTE, None)

    @property
    def wrapped(self) -> Mapping[int, WrapRecord]:
        """Read-only: ``id(model)`` → its wrap record (prefer :meth:`wrapped_record`, which checks the id's owner)."""
        live = {key: ref() for key, ref in self._wrapped.items()}
        return types.MappingProxyType({key: record for key, record in live.items() if record is not None})

    # --- backward --------------------------------------------------------------------------------
    def backward_started(self) -> None:
        """Called by every backward hook; → BACKWARD, queueing the end-of-backward callback once per pass.

        Keyed by the graph task, so a backward that raised (and never ran its callback) does not
        stop the next one from queueing its own.
        """
        task = _graph_task()
        if task != self._callback_task and not self._inner:
            Variable._execution_engine.queue_callback(self._backward_finished)
            self._callback_task = task

    @contextlib.contextmanager
    def inner_backward(self) -> Iterator[None]:
        """Backward passes run in the body, inside the running one (a pipeline's micro-batches), end with it."""
        self.backward_started()
        self._inner += 1
        try:
            yield
        finally:
            self._inner -= 1

    def add_reductions(self, pending: List[PendingReduction], *, final: bool = False) -> None:
        """Reductions just issued; ``final``: no more gradient reaches these buffers in this backward."""
        self.backward_started()
        self._pending.extend((reduction, final) for reduction in pending)
        while len(self._pending) > self.schedule.max_pending_reductions:
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
            _call_weak(self._grad_listeners, reduction.buffer)

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
        shown = [p for p in self._backward_participants()
                 if getattr(p, "show_for_recompute", None) and p.show_for_recompute()]
        try:
            yield
        finally:
            for participant in shown:
                participant.hide()

    def recover_if_stale(self) -> None:
        """BACKWARD → IDLE: a new forward starts while a backward never finished (it raised, the caller went on).

        Its reductions are waited for and dropped (the caller has zeroed or will zero the
        gradients; adding them later would corrupt the next step) and its participants released.
        """
        if self._callback_task == -1 or in_backward():
            return
        pending, self._pending = self._pending, []
        for reduction, _ in pending:
            reduction.discard()
        self._wait_host_grads()
        participants = self._take_backward_participants()
        for participant in participants:
            participant.backward_done()
        self._callback_task = -1
        self.schedule.order.restart()

    def _backward_finished(self) -> None:
        """BACKWARD → IDLE: the autograd engine finished the pass our callback was queued on."""
        self._callback_task = -1
        self.finish_reductions()
        self._wait_host_grads()
        participants = self._take_backward_participants()
        for participant in participants:
            participant.backward_done()
        self.schedule.order.step_seen()
        self.passes_done += 1
        self._tell(2, participants)

    def _wait_host_grads(self) -> None:
        """Gradients of offloaded buffers are read on the host after backward: wait for their copies."""
        buffers, self._host_grads = self._host_grads, {}
        for buffer in buffers.values():
            buffer.wait_grads()


def _call_weak(listeners: List["weakref.WeakMethod[Callable[..., None]]"], *args: Any) -> None:
    """Call each live bound method of ``listeners`` with ``args``; drop the dead ones."""
    for listener in list(listeners):
        method = listener()
        if method is None:
            listeners.remove(listener)
        else:
            method(*args)


def engine(ctx: Optional[DistContext] = None) -> Engine:
    """The engine of this process's context (created on first use)."""
    ctx = ctx or current()
    if ctx.engine is None:
        ctx.engine = Engine(ctx)
    eng = ctx.engine
    assert isinstance(eng, Engine), f"rank {ctx.rank}: the context holds a {type(eng).__name__}, not an Engine"
    return eng
