"""PipelineTransformerBlockList: BMTrain's pipeline parallelism over the stages of ``init_distributed(pipe_size=P)``.

[Note: the pipeline schedule]
The ranks form P stages (see [Note: pipeline layout] in ``bmtwrap/engine/stages.py``); stage s holds a
contiguous part of the layers (BMTrain's partition: the first ``n % P`` stages one layer more than the others),
sharded over its ranks, and a layer is stored on its stage only. A pipeline is the P ranks with one place in
their stages (``bmt.config["pipe_comm"]``). Each rank calls the list with its own batch of B rows, as with
data parallelism; the list runs the pipeline's P x B rows in ``bmt.config["micros"]`` micro-batches (GPipe):

    forward   the P batches are all-gathered along the pipeline (the ``batch_related`` arguments too), in
              stage order; for each micro-batch in turn, stage s receives its input from stage s - 1 (stage 0
              takes it from the gathered batch), runs its layers (blocks that recompute in backward, as
              BMTrain's do) and sends the output to stage s + 1. The last stage broadcasts the outputs to the
              pipeline, and each rank returns the rows of its own batch: the user's loss code is unchanged.
    backward  the output gradients are all-gathered along the pipeline; for each micro-batch in the same
              order, the last stage takes its gradient from them, the others receive it from stage s + 1;
              each stage runs that micro-batch's backward through its layers (a backward inside the one
              running: ``Engine.inner_backward``) and sends the input's gradient to stage s - 1. Stage 0
              broadcasts the inputs' gradients and each rank keeps its rows; the gradients of the other
              tensor arguments are summed over the pipeline.

Point-to-point transfers are ``bmt.distributed.send_activations``/``recv_activations`` on the pipe group
(``torch.distributed`` send and receive). A layer's gradient, summed over the pipeline's micro-batches and
reduce-scattered in its stage, is divided by P (``FlatBuffer.one_stage``): the mean over the W ranks'
losses, as for every other parameter.

[Note: records inside a pipeline]
``bmt.inspect.record_tensor`` inside the pipelined layers gives the caller's ``inspect_tensor()`` what the
same layers would record without a pipeline: on every rank, each record of this rank's batch, in layer order.
While a stage's layers run, a stand-in inspector keeps each micro-batch's records; after the forward, each
record (every micro-batch's joined: the pipeline's P x B rows) is broadcast from its stage, and each rank keeps
its rows. They leave the pipeline as further outputs of its autograd function, so a loss built from a record
back-propagates: in backward, a record's gradient is gathered along the pipeline and its stage adds each
micro-batch's rows to that micro-batch's backward (a second root beside the stage's output). The record's own
gradient (``get_summary``'s ``grad_mean``/``grad_std``) is what its stage found, the later layers' share
included, handed back to each rank's record after the backward. A record must lead with the micro-batch's
rows and be made in every micro-batch alike; anything else is refused on every rank.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Set, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from ..engine import dist as _dist
from ..engine.collectives import all_gather_single
from ..engine.full_state import tp_full_shape
from ..engine.schedule import engine
from .block import Block
from .blocklist import TransformerBlockList
from .comm import config_communicator, current_topology
from .distributed import recv_activations, send_activations
from .inspect.tensor import _Record

__all__ = ["PipelineTransformerBlockList", "RemoteParameter", "share_stage_grads", "stage_layers"]


def stage_layers(layers: int, stages: int, stage: int) -> range:
    """The layers stage ``stage`` of ``stages`` holds of ``layers`` (BMTrain's partition)."""
    sizes = [layers // stages + (s < layers % stages) for s in range(stages)]
    return range(sum(sizes[:stage]), sum(sizes[: stage + 1]))


class RemoteParameter(nn.Parameter):
    """A parameter of a pipeline layer that another stage holds: no elements here (BMTrain's empty placeholder).

    Attributes:
        full_shape: the parameter's whole shape, as its stage's ``state_dict()`` gives it.
        init_method: its ``DistributedParameter``'s ``init_method``: :func:`bmtwrap.init_parameters` draws the
            same numbers here as on its stage (and drops them), so that every stage's RNG stays in step.
    """

    full_shape: torch.Size
    init_method: Any

    def __new__(cls, dtype: torch.dtype, full_shape: torch.Size, init_method: Any) -> "RemoteParameter":
        self = torch.Tensor._make_subclass(cls, torch.empty(0, dtype=dtype, device=_dist.current().device), False)
        self.full_shape, self.init_method = full_shape, init_method
        return self

    def __repr__(self) -> str:
        return f"RemoteParameter(held by another pipeline stage, shape {tuple(self.full_shape)}, {self.dtype})"


def _leave_to_other_stage(block: Block) -> None:
    """Drop the shards of a layer another stage holds; a :class:`RemoteParameter` takes each parameter's place."""
    eng = engine()
    group = block.runner.group
    for buffer in group.buffers:
        eng.registry.remove(buffer)
        for slot in buffer.slots:
            remote = RemoteParameter(slot.param.dtype, tp_full_shape(slot), getattr(slot.param, "_init_method", None))
            for module, name in slot.owners:
                module._parameters[name] = remote
    group.dissolve()


class PipelineTransformerBlockList(TransformerBlockList):
    """BMTrain's pipelined block list: its layers cut into the stages of ``init_distributed(pipe_size=P)``.

    Stage s holds layers ``get_range_by_stage_id(s)`` (contiguous; BMTrain's partition), sharded over the
    stage's ranks (``layer_ids``: this rank's stage's; ``stage_id``, ``stages``: BMTrain's attributes); the other
    layers' parameters are :class:`RemoteParameter` placeholders of no elements. A call runs the pipeline's
    batches in ``bmt.config["micros"]`` micro-batches, all forwards then all backwards (see [Note: the pipeline
    schedule]), and returns on every rank the output of its own batch, as BMTrain's does. ``state_dict()`` and
    :func:`bmtwrap.save` hold every layer's whole tensors, sent from their stages (a collective);
    :func:`bmtwrap.load` takes a file of any layout. With ``pipe_size`` 1 this is a
    :class:`TransformerBlockList` (``batch_related`` changes nothing).

    Args:
        modules: plain modules or blocks. A block's ``mode`` changes nothing here: a block built with the
            default ``mode="BLOCK"`` is taken as one built with ``"PIPE"`` (as BMTrain's older lists take any
            ``CheckpointBlock``; BMTrain 1.0.1's asserts ``"PIPE"``).
        num_hidden: how many leading arguments are hidden states (1 with ``pipe_size`` above 1).

    Raises:
        TypeError: an element is not an ``nn.Module``.
        ValueError: as :class:`TransformerBlockList`; fewer layers than pipeline stages.
        BlockSharingError: a ``Block`` given twice.
        NotImplementedError: ``num_hidden`` above 1 with ``pipe_size`` above 1.

    Example::

        bmt.init_distributed(pipe_size=2)                 # 4 processes: 2 stages of 2 ranks
        blocks = bmt.PipelineTransformerBlockList([Layer() for _ in range(24)])   # 12 layers a stage
        h = blocks(h, mask, batch_related=[0])            # mask is cut into micro-batches with h
    """

    _pipeline = True

    def __init__(self, modules: Sequence[nn.Module], num_hidden: int = 1) -> None:
        modules = list(modules)
        ctx = _dist.current()
        if ctx.pipe_size > 1 and len(modules) < ctx.pipe_size:
            raise ValueError(f"PipelineTransformerBlockList: {len(modules)} layer(s) cannot be cut into pipe_size="
                             f"{ctx.pipe_size} stages of one layer at least; give at least {ctx.pipe_size} layers, "
                             "or call init_distributed with a smaller pipe_size")
        if ctx.pipe_size > 1 and num_hidden != 1:
            raise NotImplementedError(f"PipelineTransformerBlockList(num_hidden={num_hidden}) with pipe_size="
                                      f"{ctx.pipe_size}: a pipeline passes one hidden state between stages, as "
                                      "BMTrain's does; pass the others as arguments, or use TransformerBlockList")
        super().__init__(modules, num_hidden)
        self.stages, self.stage_id = ctx.pipe_size, current_topology().stage_id
        self.layer_ids = stage_layers(len(self), ctx.pipe_size, self.stage_id)
        if ctx.pipe_size == 1:
            return
        for index, block in enumerate(self):
            if index in self.layer_ids:
                for buffer in block.runner.group.buffers:
                    buffer.one_stage = True
            else:
                _leave_to_other_stage(block)
        self.register_state_dict_post_hook(_gather_stages)
        self.register_load_state_dict_pre_hook(_skip_other_stages)

    def forward(self, *args: Any, batch_related: Sequence[int] = (), return_hidden_states: bool = False,
                **kwargs: Any) -> Any:
        """Run the layers; with ``pipe_size`` above 1, through the pipeline (see [Note: the pipeline schedule]).

        Args:
            *args: the hidden state (dimension 0: this rank's batch), then arguments every layer gets.
            batch_related: which of the other arguments (0: the first after the hidden state) are cut into
                micro-batches along dimension 0 with the hidden state; default, as BMTrain: every tensor
                argument whose dimension 0 is the batch size.
            return_hidden_states: also return the inputs of every block (``pipe_size`` 1 only).
            **kwargs: passed to every layer unchanged (not tensors, with ``pipe_size`` above 1).

        Returns:
            The last layer's output for this rank's batch (a tensor, the same on every rank as without pipelines).

        Raises:
            ValueError: the pipeline's ``P x B`` rows do not split into ``bmt.config["micros"]`` micro-batches.
            TypeError: a layer returns something other than a tensor (``pipe_size`` above 1).
            NotImplementedError: ``return_hidden_states`` or a tensor keyword argument with ``pipe_size`` above 1.
        """
        ctx = _dist.current()
        if ctx.pipe_size == 1:
            return super().forward(*args, return_hidden_states=return_hidden_states, **kwargs)
        if return_hidden_states or any(isinstance(v, torch.Tensor) for v in kwargs.values()):
            raise NotImplementedError(
                "PipelineTransformerBlockList under pipe_size > 1 takes neither return_hidden_states nor tensor "
                "keyword arguments; pass tensors positionally (list those cut with the batch in batch_related)")
        if not args:
            raise ValueError("PipelineTransformerBlockList needs the hidden state as its first positional argument")
        hidden, rest = args[0], args[1:]
        rows = hidden.shape[0] * ctx.pipe_size
        if rows % ctx.micro_batches:
            raise ValueError(
                f"PipelineTransformerBlockList: the pipeline's {ctx.pipe_size} x {hidden.shape[0]} rows do not split "
                f"into num_micro_batches={ctx.micro_batches} micro-batches; give a batch size whose product with "
                "pipe_size divides by it, or another init_distributed(num_micro_batches=...)")
        split = tuple(isinstance(a, torch.Tensor) and (i in batch_related if batch_related else
                                                       a.dim() > 0 and a.shape[0] == hidden.shape[0])
                      for i, a in enumerate(rest))
        run = _Run(self, split, kwargs, torch.is_grad_enabled())
        placeholder = torch.empty(0, requires_grad=run.with_grad)  # so that the output records a backward
        result, *records = _Pipeline.apply(run, placeholder, hidden, *rest)
        if records:
            run.hand_to(ctx.inspector, records)
        return result

    def get_range_by_stage_id(self, stage_id: int) -> range:
        """The layers stage ``stage_id`` holds (BMTrain's name)."""
        return stage_layers(len(self), self.stages, stage_id)

    def get_part_len_by_stage_id(self, stage_id: int) -> int:
        """How many layers stage ``stage_id`` holds (BMTrain's name)."""
        return len(self.get_range_by_stage_id(stage_id))

    def get_stage_by_layer_id(self, layer_id: int) -> int:
        """The stage that holds layer ``layer_id`` (BMTrain's name)."""
        return next(s for s in range(self.stages) if layer_id in self.get_range_by_stage_id(s))

    def _run_stage(self, x: torch.Tensor, args: Sequence[Any], kwargs: Dict[str, Any]) -> torch.Tensor:
        for index in self.layer_ids:
            x = self[index](x, *args, **kwargs)
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"layer {index} of a PipelineTransformerBlockList returned a {type(x).__name__}; under "
                                "pipe_size > 1 each layer returns the hidden state alone, a tensor, as in BMTrain")
        return x


class _Run:
    """One call of a pipeline list: its options, and what its forward keeps for its backward."""

    def __init__(self, blocks: PipelineTransformerBlockList, split: Tuple[bool, ...], kwargs: Dict[str, Any],
                 with_grad: bool) -> None:
        ctx = _dist.current()
        self.blocks, self.split, self.kwargs, self.with_grad = blocks, split, kwargs, with_grad
        self.stages, self.stage, self.micros = ctx.pipe_size, blocks.stage_id, ctx.micro_batches
        self.comm = config_communicator("pipe_comm")
        self.group = ctx.replica_group  # the pipe group
        self.inputs: List[torch.Tensor] = []  # each micro-batch's input of this stage (a leaf)
        self.outputs: List[torch.Tensor] = []  # and its output
        self.args: List[List[Any]] = []  # each micro-batch's other arguments (leaves where tensors)
        self.gathered_shape = torch.Size()
        self.recorded: List[Tuple[int, int, _Recorded]] = []  # (stage, place, what) of every stage's records
        self.own_records: List[List[_Record]] = []  # this stage's records, per micro-batch
        self.handed: List[Optional["weakref.ref[torch.Tensor]"]] = []  # the records the inspector got

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every stage's ``x`` of the pipeline, joined along dimension 0 in stage order."""
        x = x.detach().contiguous()
        out = torch.empty((self.stages * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        all_gather_single(out, x, group=self.group)
        return out

    def broadcast(self, x: torch.Tensor, stage: int) -> torch.Tensor:
        dist.broadcast(x, src=self.comm.global_rank(stage), group=self.group)
        return x

    def stage_rows(self, stage: int, index: int, what: _Recorded,
                   of_record: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``of_record(tensor)`` of record ``index`` of stage ``stage``, every micro-batch's joined on that stage and
        broadcast along the pipeline: this rank's rows (see [Note: records inside a pipeline])."""
        if stage == self.stage:
            full = torch.cat([of_record(records[index].tensor) for records in self.own_records])
        else:
            full = torch.empty((self.gathered_shape[0], *what.tail), dtype=what.dtype, device=_dist.current().device)
        return self.broadcast(full, stage).chunk(self.stages)[self.stage].clone()

    def hand_to(self, inspector: Any, records: Sequence[torch.Tensor]) -> None:
        """Give the caller's inspector the records, in stage and layer order, as if recorded here."""
        world = _dist.current().world_size
        self.handed = []
        for tensor, (_, _, what) in zip(records, self.recorded):
            keep = what.keep_grad and tensor.requires_grad
            if keep:
                tensor.retain_grad()
            inspector._record(_Record(name=what.name, group=what.group, requires_grad=keep, tensor=tensor,
                                      shape=(tensor.shape[0] * world, *what.tail)))
            self.handed.append(weakref.ref(tensor) if keep else None)

    def hand_back_record_grads(self) -> None:
        """Each kept record's gradient as its stage found it (through the later layers too), to this rank's rows."""
        for (stage, index, what), handed in zip(self.recorded, self.handed):
            if not what.keep_grad or not what.differentiable:
                continue
            rows = self.stage_rows(stage, index, what, _grad_or_zeros)
            tensor = handed() if handed is not None else None
            if tensor is not None:
                tensor.grad = rows

    def micro_args(self, args: Sequence[Any]) -> None:
        """Each micro-batch's arguments: those cut with the batch, in pieces of the pipeline's rows; the others
        shared (one leaf, whose gradient sums over the micro-batches)."""
        columns = []
        for arg, split in zip(args, self.split):
            if split:
                columns.append([piece.requires_grad_(arg.requires_grad)
                                for piece in self.gather(arg).chunk(self.micros)])
            elif isinstance(arg, torch.Tensor):
                columns.append([arg.detach().requires_grad_(arg.requires_grad)] * self.micros)
            else:
                columns.append([arg] * self.micros)
        self.args = [[column[m] for column in columns] for m in range(self.micros)]


@contextlib.contextmanager
def _inspector(standing_in: Any) -> Iterator[None]:
    """The process's active inspector replaced by ``standing_in`` (or none) inside the ``with``."""
    ctx = _dist.current()
    saved, ctx.inspector = ctx.inspector, standing_in
    try:
        yield
    finally:
        ctx.inspector = saved


def _grad_or_zeros(x: torch.Tensor) -> torch.Tensor:
    return x.grad if x.grad is not None else torch.zeros_like(x)


class _Collect:
    """Stands for the active ``inspect_tensor()`` while a stage's layers run: each micro-batch's records."""

    def __init__(self) -> None:
        self.micros: List[List[_Record]] = []

    def _record(self, record: _Record) -> None:
        self.micros[-1].append(record)


class _Recorded(NamedTuple):
    """What one stage recorded at one place of its layers, the same in every micro-batch."""

    name: str
    group: Optional[str]
    keep_grad: bool  # record_tensor(requires_grad=...) and the tensor needed one
    differentiable: bool
    tail: Tuple[int, ...]  # the shape after dimension 0
    dtype: torch.dtype


def _stage_records(collect: _Collect, rows: int) -> Union[List[_Recorded], str]:
    """What this stage's layers recorded, or why it cannot be handed on (see [Note: records inside a pipeline])."""
    first = collect.micros[0]
    for records in collect.micros:
        if [(r.name, r.group) for r in records] != [(r.name, r.group) for r in first]:
            return "the layers recorded different tensors in different micro-batches"
        for r in records:
            if r.tensor.dim() == 0 or r.tensor.shape[0] != rows:
                return (f"'{r.name}' of shape {tuple(r.tensor.shape)} does not lead with the micro-batch's {rows} "
                        "rows")
    return [_Recorded(r.name, r.group, r.requires_grad, r.tensor.requires_grad, tuple(r.tensor.shape[1:]),
                      r.tensor.dtype) for r in first]


class _Pipeline(torch.autograd.Function):
    """The pipeline of one call: forward and backward as [Note: the pipeline schedule] says."""

    @staticmethod
    def forward(ctx: Any, run: _Run, placeholder: torch.Tensor, hidden: torch.Tensor, *args: Any) -> Any:
        ctx.run = run
        full = run.gather(hidden)
        run.gathered_shape = full.shape
        run.micro_args(args)
        micro = full.chunk(run.micros)
        collect = _Collect() if _dist.current().inspector is not None else None
        with _inspector(collect), torch.set_grad_enabled(run.with_grad):
            for m in range(run.micros):
                x = micro[m] if run.first else recv_activations(run.stage - 1, run.comm)
                x = x.detach().requires_grad_(run.with_grad)
                if collect is not None:
                    collect.micros.append([])
                y = run.blocks._run_stage(x, run.args[m], run.kwargs)
                if not run.last:
                    send_activations(y.detach(), run.stage + 1, run.comm)
                run.inputs.append(x)
                run.outputs.append(y)
        mine = _stage_records(collect, micro[0].shape[0]) if collect is not None else []
        result = torch.cat([y.detach() for y in run.outputs]) if run.last else hidden
        found: List[Any] = [None] * run.stages  # the output's shape and dtype, and what each stage recorded
        dist.all_gather_object(found, (tuple(result.shape), result.dtype, mine), group=run.group)
        refused = [(stage, why) for stage, (_, _, why) in enumerate(found) if isinstance(why, str)]
        if refused:  # every rank of the pipeline raises
            raise NotImplementedError(
                "bmt.inspect.record_tensor inside the layers of a PipelineTransformerBlockList "
                f"(stage {refused[0][0]}): {refused[0][1]}; under pipe_size > 1 a record must be a tensor of the "
                "micro-batch's rows, recorded in every micro-batch alike; record outside the pipelined layers, or "
                "inspect with pipe_size=1")
        if not run.last:
            result = torch.empty(found[-1][0], dtype=found[-1][1], device=hidden.device)
        run.broadcast(result, run.stages - 1)
        run.recorded = [(stage, index, what) for stage, (_, _, made) in enumerate(found)
                        for index, what in enumerate(made)]
        run.own_records = collect.micros if collect is not None and mine else []
        records = [run.stage_rows(stage, index, what, torch.Tensor.detach) for stage, index, what in run.recorded]
        ctx.mark_non_differentiable(*[r for r, (_, _, what) in zip(records, run.recorded) if not what.differentiable])
        if not run.with_grad:
            run.inputs, run.outputs, run.args, run.own_records = [], [], [], []
        return (result.chunk(run.stages)[run.stage].clone(), *records)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor,
                 *record_grads: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:
        run: _Run = ctx.run
        grads = run.gather(grad).chunk(run.micros)
        # Each record's gradient, gathered along the pipeline: its stage adds it in each micro-batch's backward.
        own = []
        for (stage, index, what), g in zip(run.recorded, record_grads):
            if what.differentiable:
                g = g if g is not None else grad.new_zeros((grad.shape[0], *what.tail), dtype=what.dtype)
                pieces = run.gather(g).chunk(run.micros)  # every rank of the pipeline takes part
                if stage == run.stage:
                    own.append((index, pieces))
        with _inspector(None), engine().inner_backward():  # a recomputation records nothing twice
            for m in range(run.micros):
                g = grads[m] if run.last else recv_activations(run.stage + 1, run.comm)
                roots = [run.outputs[m]] + [run.own_records[m][index].tensor for index, _ in own]
                torch.autograd.backward(roots, [g] + [pieces[m] for _, pieces in own])
                if not run.first:
                    send_activations(_grad_or_zeros(run.inputs[m]), run.stage - 1, run.comm)
        run.hand_back_record_grads()
        if run.first:
            inputs = torch.cat([_grad_or_zeros(x) for x in run.inputs])
        else:
            inputs = torch.empty(run.gathered_shape, dtype=grad.dtype, device=grad.device)
        hidden_grad = run.broadcast(inputs, 0).chunk(run.stages)[run.stage].clone()
        arg_grads = [_arg_grad(run, i) for i in range(len(run.split))]
        run.inputs, run.outputs, run.args, run.own_records = [], [], [], []
        return (None, None, hidden_grad, *arg_grads)


def _arg_grad(run: _Run, index: int) -> Optional[torch.Tensor]:
    """The gradient of argument ``index`` of this rank's call: summed over the pipeline's stages, this rank's rows
    of an argument cut with the batch; of a shared one, a P-th of the sum (each of the P ranks passed it)."""
    pieces = [args[index] for args in run.args]
    if not isinstance(pieces[0], torch.Tensor) or not pieces[0].requires_grad:
        return None
    if run.split[index]:
        total = torch.cat([_grad_or_zeros(p) for p in pieces])
    else:
        total = pieces[0].grad.clone() if pieces[0].grad is not None else torch.zeros_like(pieces[0])
    dist.all_reduce(total, group=run.group)
    return total.chunk(run.stages)[run.stage].clone() if run.split[index] else total / run.stages


def _layer_parameters(block: Block) -> Iterator[Tuple[str, nn.Parameter]]:
    return block._module.named_parameters(remove_duplicate=False)


@torch.no_grad()
def _gather_stages(blocks: PipelineTransformerBlockList, state_dict: Dict[str, Any], prefix: str,
                   local_metadata: Any) -> None:
    """State-dict post-hook: every layer's whole tensors, each broadcast along the pipeline from its stage.

    A collective of every rank. A layer of this stage keeps its entries (whole CPU tensors, or with
    ``keep_vars=True`` the sharded parameters); another stage's layer gets whole CPU tensors (with
    ``keep_vars=True`` as parameters, which writing into changes nothing here).
    """
    ctx = _dist.current()
    pipe = config_communicator("pipe_comm")
    for stage in range(ctx.pipe_size):
        mine = stage == blocks.stage_id
        for index in blocks.get_range_by_stage_id(stage):
            block, whole = blocks[index], None
            for name, param in _layer_parameters(block):
                key = f"{prefix}{index}.{name}"
                value = state_dict.get(key)
                if mine and (value is None or isinstance(value, nn.Parameter)):  # keep_vars=True: the shards
                    whole = block.state_dict() if whole is None else whole  # gathered in the stage
                    value = whole[name]
                value = (value.to(ctx.device) if mine else
                         torch.empty(param.full_shape, dtype=param.dtype, device=ctx.device))
                dist.broadcast(value, src=pipe.global_rank(stage), group=ctx.replica_group)
                if not mine and key in state_dict:  # with keep_vars=True a parameter, as the others are
                    keep_vars = isinstance(state_dict[key], nn.Parameter)
                    state_dict[key] = nn.Parameter(value.cpu(), requires_grad=False) if keep_vars else value.cpu()


def _skip_other_stages(blocks: PipelineTransformerBlockList, state_dict: Dict[str, Any], prefix: str,
                       *args: Any) -> None:
    """Load-state-dict pre-hook: another stage's layers keep their placeholders (their stage loads them)."""
    for index, block in enumerate(blocks):
        if index in blocks.layer_ids:
            continue
        for name, param in _layer_parameters(block):
            if f"{prefix}{index}.{name}" in state_dict:
                state_dict[f"{prefix}{index}.{name}"] = param


@torch.no_grad()
def share_stage_grads(model: nn.Module, grads: Dict[str, torch.Tensor]) -> Set[str]:
    """Fill ``grads`` (whole gradients under the unwrapped model's keys, as ``full_grad_dict`` gives them) for the
    layers of ``model``'s pipelined lists that other stages hold, each broadcast along the pipeline from its stage.

    A collective of every rank. Returns the keys filled whose stage held a gradient.
    """
    ctx, pipe, filled = _dist.current(), config_communicator("pipe_comm"), set()
    for path, blocks in model.named_modules():
        if not isinstance(blocks, PipelineTransformerBlockList) or blocks.stages == 1:
            continue
        for index, block in enumerate(blocks):
            stage = blocks.get_stage_by_layer_id(index)
            mine = stage == blocks.stage_id
            for name, param in _layer_parameters(block):
                key = ".".join(part for part in f"{path}.{index}.{name}".split(".") if part and part != "_module")
                shape = grads[key].shape if mine else param.full_shape
                value = grads[key].to(ctx.device) if mine else torch.empty(shape, dtype=param.dtype, device=ctx.device)
                held = torch.tensor([float(mine and param.grad is not None)], device=ctx.device)
                dist.broadcast(held, src=pipe.global_rank(stage), group=ctx.replica_group)
                dist.broadcast(value, src=pipe.global_rank(stage), group=ctx.replica_group)
                if not mine:
                    grads[key] = value
                    if held.item():
                        filled.add(key)
    return filled

