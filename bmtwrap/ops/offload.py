"""OffloadQueue: Adam updates of parameter shards run on the CPU by a C++ worker thread, with the gradient
and parameter copies of GPU shards (csrc/cpu/offload.cpp, csrc/cuda/offload_link.cu).

What is offloaded, the host memory it lives in and the staging sizes are ``bmtwrap.engine.offload``'s; this
module is only the queue's checked entry point into the extension.
"""

from __future__ import annotations

import functools
import numbers
from typing import Callable, NamedTuple

import torch

from . import _ext
from .adam_cpu import _check_adam_hyper, adam_step_cpu


# Finished updates are looked for once every this many waits (a look costs one call per queued update).
_DROP_EVERY = 16


class OffloadUpdate(NamedTuple):
    """One parameter shard's update for :class:`OffloadQueue`."""

    param: torch.Tensor  # the shard, on the queue's device or the CPU; rewritten with the new values
    grad: torch.Tensor  # its gradient: same element count, any float dtype; where param is, or on the CPU
    master: torch.Tensor  # the fp32 master on the CPU; ``param`` itself for an fp32 CPU shard
    exp_avg: torch.Tensor  # fp32, CPU
    exp_avg_sq: torch.Tensor  # fp32, CPU
    hyper: dict  # keyword arguments of adam_step_cpu: lr, beta1, beta2, eps, weight_decay, step, ...
    priority: int  # lower first once the queue is prioritised
    # Where the new master and moments go: None, in place; else fp32 CPU tensors of the same size, disjoint from
    # the inputs, which are then only read (a step that may be redone from the same state).
    master_out: torch.Tensor | None = None
    exp_avg_out: torch.Tensor | None = None
    exp_avg_sq_out: torch.Tensor | None = None
    # Updates with the same order key run in the order they were submitted (None: those of the same master).
    order: int | None = None

    def targets(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        return self.master_out, self.exp_avg_out, self.exp_avg_sq_out


class OffloadTicket:
    """One submitted update: :meth:`wait` for it before reading its parameter."""

    __slots__ = ("_ticket", "_device", "_release")

    def __init__(self, ticket: object, device: torch.device, release: Callable[[], None] | None = None) -> None:
        self._ticket = ticket
        self._device = device
        self._release = release  # drops the queue's references to the update's tensors

    def done(self) -> bool:
        """Whether the update has finished on the host (on a GPU: its copy back is queued)."""
        return self._ticket is None or self._ticket.done()

    def wait(self) -> None:
        """Block until the update is done; on a GPU, make the device's current stream wait for its copy back.

        Raises:
            RuntimeError: the update failed on the worker thread (the message says why).
        """
        if self._ticket is not None:
            stream = _ext.current_raw_stream(self._device.index) if self._device.type == "cuda" else 0
            self._ticket.wait(stream)
        if self._release is not None:
            # Done on the host: its gradient (on a GPU, memory the next forward needs) can go now.
            self._release()
            self._release = None


class OffloadQueue:
    """Adam(W) updates of parameter shards, run on the CPU by a C++ worker thread while Python goes on.

    :meth:`submit` returns at once. The worker cuts each update into chunks of ``chunk_numel``
    elements; for shards on a GPU it copies each gradient chunk into pinned staging (once the
    current stream has reached the point of submission), runs :func:`adam_step_cpu`'s kernel on
    the fp32 master and moments in CPU memory and copies the new parameters back, the three
    overlapping across chunks; CPU shards are updated in place. A queue for a GPU also takes CPU
    shards whose gradients the current stream is still copying to the host (parameters offloaded
    by ``wrap(offload_params=True)``): it updates them in place once the stream has reached the
    point of submission. Likewise a GPU shard's gradient may come already copied to (pinned) host
    memory by the current stream, so that the GPU memory of a gradient waiting for the CPU is freed
    at once: the worker reads it there once the stream has reached the point of submission, and
    copies the new parameters back as usual. The worker never needs the GIL.
    It takes the newest update first (or by priority, see :meth:`prioritise`); updates of the same
    buffers always run in the order they were submitted.
    See [Note: offload queue] in ``csrc/cpu/offload.cpp``. The queue keeps each update's tensors
    alive until it is done: until its ticket is waited for, or a later submit finds it done (so
    that a gradient on the GPU is freed before the next forward needs the memory). Without the compiled extension (or its CUDA half, for a GPU) every
    update runs synchronously in :meth:`submit`, through :func:`adam_step_cpu`.

    Args:
        device: where the parameters are (``cpu`` or one CUDA device).
        dtypes: every parameter dtype it will update (sizes the staging).
        chunk_numel: elements per chunk.
        slots: pinned staging slots on a GPU, at least 2: pinned memory is ``slots * chunk_numel *
            2 * (largest element size)``.
        num_threads: CPU threads of the Adam kernel (None: ``torch.get_num_threads()``).

    Raises:
        ValueError: bad sizes or counts.
    """

    def __init__(self, device: torch.device, *, dtypes: set[torch.dtype], chunk_numel: int, slots: int,
                 num_threads: int | None = None) -> None:
        if not isinstance(chunk_numel, int) or chunk_numel < 1 or not isinstance(slots, int) or slots < 2:
            raise ValueError(f"need chunk_numel >= 1 and slots >= 2, got {chunk_numel!r} and {slots!r}")
        if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
            raise ValueError(f"num_threads must be a positive int or None, got {num_threads!r}")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._itemsize = max([d.itemsize for d in dtypes] + [2])
        # Each queued update's tensors, until it is waited for or found done (keyed by submission number).
        self._held: dict[int, tuple[object, tuple[torch.Tensor, ...]]] = {}
        self._submitted = 0
        self._waits = 0
        self._extension = _ext.extension_for(device)
        self._queue = None
        if self._extension is not None:
            threads = torch.get_num_threads() if num_threads is None else num_threads
            index = device.index if device.type == "cuda" else -1
            out_bytes = chunk_numel * self._itemsize if any(d != torch.float32 for d in dtypes) else 0
            self._queue = self._extension.OffloadQueue(index, chunk_numel, slots, chunk_numel * self._itemsize,
                                                       out_bytes, threads)

    def submit(self, updates: list[OffloadUpdate],
               ready_stream: torch.cuda.Stream | None = None) -> list[OffloadTicket]:
        """Queue ``updates``; returns one ticket per update, in order.

        On a GPU the gradients are read once ``ready_stream`` (default: the current stream) has reached
        this point.

        Raises:
            TypeError, ValueError: a tensor or hyper-parameter is not what :class:`OffloadUpdate`
                describes (nothing is queued then).
            RuntimeError: an earlier update failed on the worker thread.
        """
        hypers = [self._check(u) for u in updates]
        self.check()
        if not updates:
            return []
        if self._queue is None:
            if self.device.type == "cuda" and any(u.grad.device.type == "cpu" for u in updates):
                # Host gradients may still be arriving.
                (ready_stream or torch.cuda.current_stream(self.device)).synchronize()
            for u in updates:
                self._run_now(u)
            return [OffloadTicket(None, self.device) for _ in updates]
        ext = self._extension
        specs = [(u.param.data_ptr(), _ext.dtype_code(ext, u.param.dtype),
                  u.grad.data_ptr(), _ext.dtype_code(ext, u.grad.dtype),
                  u.master.data_ptr(), u.exp_avg.data_ptr(), u.exp_avg_sq.data_ptr(), u.param.numel(), *h, u.priority,
                  u.param.device.type == "cpu", u.param.is_cuda and u.grad.device.type == "cpu",
                  *(0 if t is None else t.data_ptr() for t in u.targets()), u.order or 0)
                 for u, h in zip(updates, hypers)]
        if self.device.type != "cuda":
            ready = 0
        else:
            ready = _ext.current_raw_stream(self.device.index) if ready_stream is None else ready_stream.cuda_stream
        self._drop_done()
        tickets = self._queue.submit(specs, ready)
        keys = range(self._submitted, self._submitted + len(tickets))
        self._submitted += len(tickets)
        self._held.update((key, (t, (*u[:5], *u.targets()))) for key, t, u in zip(keys, tickets, updates))
        # The parameters change behind autograd's back: copies gathered from the old values are stale.
        torch.autograd.graph.increment_version([u.param for u in updates])
        return [OffloadTicket(t, self.device, functools.partial(self._waited, key)) for key, t in zip(keys, tickets)]

    def _waited(self, key: int) -> None:
        """An update was waited for: drop its tensors, and every few waits those of all finished updates
        (the next forward waits for its blocks in order, while the worker finishes later ones too)."""
        self._held.pop(key, None)
        self._waits += 1
        if self._waits % _DROP_EVERY == 0:
            self._drop_done()

    def _drop_done(self) -> None:
        for key in [key for key, (ticket, _) in self._held.items() if ticket.done()]:
            del self._held[key]

    def prioritise(self) -> None:
        """From now until the queue is next empty, run the lowest ``priority`` first instead of the newest
        (updates submitted right after this call included). Updates of one buffer keep their order."""
        if self._queue is not None:
            self._queue.prioritise()

    def wait_all(self) -> None:
        """Block until every update is done on the host; raise if one failed since the last check."""
        if self._queue is not None:
            self._queue.wait_all()
            self._held.clear()

    def stats(self) -> dict[str, float]:
        """Where the worker's time went since the queue was made: ``adam_s`` (in the Adam kernel),
        ``stalled_s`` (waiting for a gradient copy, or for the gradient itself to be final), ``idle_s``
        (nothing to do), and ``elements`` updated. All zero when updates run synchronously."""
        if self._queue is None:
            return dict(adam_s=0.0, stalled_s=0.0, idle_s=0.0, elements=0)
        return self._queue.stats()

    def check(self) -> None:
        """Raise ``RuntimeError`` if an update failed since the last check, without waiting."""
        if self._queue is not None:
            self._queue.check()

    def _check(self, u: OffloadUpdate) -> tuple:
        if not isinstance(u, OffloadUpdate):
            raise TypeError(f"expected an OffloadUpdate, got {type(u).__name__}")
        for name in ("param", "grad", "master", "exp_avg", "exp_avg_sq"):
            tensor = getattr(u, name)
            (_ext.check_float_tensor if name in ("param", "grad") else _check_adam_state)(name, tensor)
            if tensor.numel() != u.param.numel():
                raise ValueError(f"{name} has {tensor.numel()} elements but param has {u.param.numel()}")
        host = u.param.device.type == "cpu"
        grad_on_host = u.grad.device.type == "cpu"
        for name in ("param", "grad"):
            device = getattr(u, name).device
            if device.type != "cpu" and (device != self.device or (name == "grad" and host)):
                raise ValueError(f"{name} is on {device} but the queue is for {self.device} and param is on "
                                 f"{u.param.device}; param must be on the queue's device or the CPU, and grad where "
                                 "param is or on the CPU")
            if getattr(u, name).element_size() > self._itemsize:
                raise ValueError(f"{name} has dtype {getattr(u, name).dtype}, wider than the dtypes the queue "
                                 "was made for; pass it in dtypes")
        own_master = u.master is u.param or u.master.data_ptr() == u.param.data_ptr()
        if own_master != (host and u.param.dtype == torch.float32):
            raise ValueError("master must be param itself exactly when param is an fp32 CPU tensor; otherwise "
                             "a separate fp32 CPU tensor")
        targets = {name: t for name, t in zip(("master_out", "exp_avg_out", "exp_avg_sq_out"), u.targets())
                   if t is not None}
        if targets and own_master:
            raise ValueError("a parameter that is its own master (an fp32 CPU shard) is updated in place; "
                             "master_out, exp_avg_out and exp_avg_sq_out need a separate master")
        for name, tensor in targets.items():
            _check_adam_state(name, tensor)
            if tensor.numel() != u.param.numel():
                raise ValueError(f"{name} has {tensor.numel()} elements but param has {u.param.numel()}")
        if u.order is not None and (isinstance(u.order, bool) or not isinstance(u.order, numbers.Integral)
                                    or u.order <= 0):
            raise ValueError(f"order must be a positive int or None, got {u.order!r}")
        tensors = {"master": u.master, "exp_avg": u.exp_avg, "exp_avg_sq": u.exp_avg_sq, **targets}
        if grad_on_host:
            tensors["grad"] = u.grad
        if host:
            if not own_master:
                tensors["param"] = u.param
        _ext.check_no_shared_memory(tensors)
        if isinstance(u.priority, bool) or not isinstance(u.priority, numbers.Integral):
            raise TypeError(f"priority must be an int, got {type(u.priority).__name__}")
        return tuple(_check_adam_hyper(**u.hyper))

    def _run_now(self, u: OffloadUpdate) -> None:
        """The update, synchronously, through adam_step_cpu (its kernel where only the CUDA half is missing)."""
        rounded = None if u.param.dtype == torch.float32 else torch.empty(u.param.numel(), dtype=u.param.dtype)
        state = []
        for source, target in zip((u.master, u.exp_avg, u.exp_avg_sq), u.targets()):
            if target is not None:
                target.view(-1).copy_(source.view(-1))  # then updated in place there
            state.append((source if target is None else target).view(-1))
        adam_step_cpu(state[0], u.grad.reshape(-1).cpu(), state[1], state[2], out=rounded, **u.hyper)
        if u.master.data_ptr() != u.param.data_ptr():
            with torch.no_grad():
                u.param.view(-1).copy_(state[0] if rounded is None else rounded)
        torch.autograd.graph.increment_version([u.param])


def _check_adam_state(name: str, tensor: object) -> None:
    """A contiguous fp32 CPU tensor (master weights or moments of an offloaded update)."""
    _ext.check_float_tensor(name, tensor)
    if tensor.dtype != torch.float32 or tensor.device.type != "cpu":
        raise TypeError(f"{name} is a {tensor.dtype} tensor on {tensor.device}; expected torch.float32 on the CPU")
