"""BMTrain's tensor-parallel layers: column- and row-parallel linear layers, the vocabulary-parallel
embedding and projection, and ``OpParallelLinear``.

They split their weights over the tensor-parallel group of ``init_distributed(tp_size=T)``
(``bmt.config["tp_comm"]``): each rank holds one slice, a ``DistributedParameter(tp_mode=True)``
that ZeRO then shards over the ranks with the same tensor-parallel place. Activations between them
are cut as BMTrain cuts them (rows, columns or whole; see [Note: tensor parallelism] in
``bmtwrap/engine/tp.py``). With ``tp_size`` 1 each layer is its plain counterpart.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Optional

import torch
import torch.nn.functional as F

from ..module import DistributedModule
from ..initializer import ParameterInitializer
from ...engine import dist as _dist
from ...engine import tp as _tp
from ...engine.param import DistributedParameter

__all__ = ["ColumnParallelLinear", "OpParallelLinear", "Projection", "ReduceType", "RowParallelLinear",
           "VPEmbedding", "VPProjection"]


def _slice_of(size: int, what: str, name: str) -> int:
    tp_size = _dist.current().tp_size
    if size % tp_size:
        raise ValueError(f"{name}: {what}={size} does not divide among tp_size={tp_size} ranks; give a multiple of "
                         f"{tp_size}")
    return size // tp_size


class ReduceType(Enum):
    """How :class:`OpParallelLinear` combines the group's partial outputs (BMTrain's enum)."""

    ALL_REDUCE = 1  # every rank gets the whole sum
    REDUCE_SCATTER = 2  # each rank gets its rows of the sum


class OpParallelLinear:
    """BMTrain's tensor-parallel ``F.linear`` of this rank's ``weight`` slice, with the group's collectives.

    ``apply(input, weight, bias=None, gather_input=False, gather_output=False, split_input=False,
    reduce_output_type=None, async_gather_chunks=2)``: ``gather_input`` joins the group's rows of
    ``input`` first; ``split_input`` (with it) keeps this rank's slice of their last dimension;
    ``gather_output`` joins the group's output columns; ``reduce_output_type`` sums the partial
    outputs (:class:`ReduceType`, or its value). ``async_gather_chunks`` is accepted and ignored.

    Example::

        y = bmt.nn.OpParallelLinear.apply(x_rows, weight, bias, True, False)   # (T * n, out / T)
    """

    @staticmethod
    def apply(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
              gather_input: bool = False, gather_output: bool = False, split_input: bool = False,
              reduce_output_type: Any = None, async_gather_chunks: int = 2) -> torch.Tensor:
        """The output, cut as the options say (see the class)."""
        del async_gather_chunks  # BMTrain's overlap of the gather with the matmul on CUDA streams
        reduce = None if reduce_output_type is None else ReduceType(reduce_output_type)
        if gather_input and split_input:
            x = _tp.gather_rows_split_columns(input)
        elif gather_input:
            x = _tp.gather_rows(input)
        elif split_input:
            raise ValueError("OpParallelLinear: split_input=True needs gather_input=True (the rows are joined "
                             "before this rank's columns are kept)")
        else:
            x = input if reduce is not None else _tp.copy_whole(input)
        out = F.linear(x, weight, bias)
        if gather_output:
            out = _tp.gather_columns(out)
        if reduce is ReduceType.ALL_REDUCE:
            out = _tp.all_reduce_whole(out)
        elif reduce is ReduceType.REDUCE_SCATTER:
            out = _tp.reduce_scatter_rows(out)
        return out


class ColumnParallelLinear(DistributedModule):
    """BMTrain's column-parallel linear layer: each rank holds ``out_features / tp_size`` rows of the weight.

    The input is this rank's rows (dimension 0) of the batch: they are joined over the group
    (``gather_input``), multiplied by the rank's slice of the weight, and the output is this
    rank's ``out_features / tp_size`` columns for every row, or with ``gather_output`` all of them.

    Args:
        in_features: size of the input's last dimension.
        out_features: size of the whole output's last dimension; a multiple of ``tp_size``.
        bias: add a learned bias (split like the weight's rows).
        dtype: the parameters' dtype; default: torch's default dtype.
        gather_output: return every column (whole output) instead of this rank's.
        gather_input: BMTrain's switch; ``False`` takes the whole input on every rank instead of rows.
        async_gather_chunks: BMTrain's overlap on CUDA streams; accepted and ignored.

    Raises:
        ValueError: ``out_features`` not a multiple of ``tp_size``.

    Example::

        up = bmt.nn.ColumnParallelLinear(1024, 4096)    # x: (n, 1024) rows -> (n * T, 4096 / T)
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype: Optional[torch.dtype] = None,
                 gather_output: bool = False, gather_input: bool = True, async_gather_chunks: int = 2) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.out_features_per_partition = _slice_of(out_features, "out_features", "ColumnParallelLinear")
        self.gather_output, self.gather_input = gather_output, gather_input
        self.weight = DistributedParameter(
            torch.empty(self.out_features_per_partition, in_features, dtype=dtype, device="meta"),
            init_method=torch.nn.init.xavier_normal_, tp_mode=True, tp_split_dim=0)
        if bias:
            self.bias = DistributedParameter(torch.empty(self.out_features_per_partition, dtype=dtype, device="meta"),
                                             init_method=torch.nn.init.zeros_, tp_mode=True, tp_split_dim=0)
        else:
            self.register_parameter("bias", None)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """This rank's columns (or all, with ``gather_output``) of ``input Wᵀ + b``."""
        return OpParallelLinear.apply(input, self.weight, self.bias, self.gather_input, self.gather_output)

    def extra_repr(self) -> str:
        """The sizes, for ``repr``."""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"out_features_per_partition={self.out_features_per_partition}, bias={self.bias is not None}")


class RowParallelLinear(DistributedModule):
    """BMTrain's row-parallel linear layer: each rank holds ``in_features / tp_size`` columns of the weight.

    The input is this rank's ``in_features / tp_size`` columns of every row (a
    :class:`ColumnParallelLinear`'s output), or with ``split_input`` this rank's rows of the whole
    input. The partial products are summed over the group: the output is this rank's rows of the
    sum, or with ``all_reduce_output`` all of it on every rank; then the bias is added.

    Args:
        in_features: size of the whole input's last dimension; a multiple of ``tp_size``.
        out_features: size of the output's last dimension.
        bias: add a learned bias (whole on every rank).
        dtype: the parameters' dtype; default: torch's default dtype.
        split_input: the input is this rank's rows of the whole input.
        all_reduce_output: every rank gets the whole output instead of its rows.
        async_chunks: BMTrain's overlap on CUDA streams; accepted and ignored.

    Raises:
        ValueError: ``in_features`` not a multiple of ``tp_size``.

    Example::

        down = bmt.nn.RowParallelLinear(4096, 1024)    # (n * T, 4096 / T) -> (n, 1024) rows
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype: Optional[torch.dtype] = None,
                 split_input: bool = False, all_reduce_output: bool = False, async_chunks: int = 2) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.in_features_per_partition = _slice_of(in_features, "in_features", "RowParallelLinear")
        self.split_input, self.all_reduce_output = split_input, all_reduce_output
        self.weight = DistributedParameter(
            torch.empty(out_features, self.in_features_per_partition, dtype=dtype, device="meta"),
            init_method=torch.nn.init.xavier_normal_, tp_mode=True, tp_split_dim=1)
        if bias:
            # Added to the rows of the output, each rank's bias gradient is its rows' part of the sum: it is
            # summed over the group like any parameter used on rows; after an all-reduce it is whole already.
            self.bias = DistributedParameter(torch.empty(out_features, dtype=dtype, device="meta"),
                                             init_method=torch.nn.init.zeros_, tp_mode=all_reduce_output)
        else:
            self.register_parameter("bias", None)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``input Wᵀ`` summed over the group (this rank's rows, or whole), plus the bias."""
        reduce = ReduceType.ALL_REDUCE if self.all_reduce_output else ReduceType.REDUCE_SCATTER
        out = OpParallelLinear.apply(input, self.weight, None, self.split_input, False, self.split_input, reduce)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        """The sizes, for ``repr``."""
        return (f"in_features={self.in_features}, in_features_per_partition={self.in_features_per_partition}, "
                f"out_features={self.out_features}, bias={self.bias is not None}")


class VPEmbedding(DistributedModule):
    """BMTrain's vocabulary-parallel embedding: each rank holds ``vocab_size / tp_size`` rows of the table.

    ``forward(ids)`` looks ``ids`` up in the whole table (joined over the group) and returns the whole
    embedding on every rank; as in BMTrain's models, cut it to this rank's rows (dimension 0) before the
    blocks: ``h.chunk(bmt.config["tp_size"], dim=0)[bmt.config["tp_rank"]]`` (the table's gradient is
    the sum of the group's, each from its rows). ``forward(x, projection=True)`` joins the group's rows of
    ``x`` and projects them on this rank's slice of the vocabulary: logits for
    :class:`bmt.loss.FusedCrossEntropy(parallel=True) <bmtwrap.loss.FusedCrossEntropy>`.

    Args:
        vocab_size: classes; a multiple of ``tp_size``.
        embedding_size: size of each embedding.
        dtype: the table's dtype (BMTrain's default, ``torch.half``).
        init_mean: the mean of the normal distribution ``bmt.init_parameters`` draws the table from.
        init_std: its standard deviation.

    Raises:
        ValueError: ``vocab_size`` not a multiple of ``tp_size``.

    Example::

        emb = bmt.nn.VPEmbedding(32000, 1024, dtype=torch.bfloat16)
        h = emb(ids).chunk(tp, dim=0)[tp_rank]                  # (n, S, 1024): this rank's rows
        logits = emb(h, projection=True)                         # (n * T, S, 32000 / T)
    """

    def __init__(self, vocab_size: int, embedding_size: int, dtype: torch.dtype = torch.half,
                 init_mean: float = 0.0, init_std: float = 1) -> None:
        super().__init__()
        self.dim_model = embedding_size
        self.vocab_size_per_partition = _slice_of(vocab_size, "vocab_size", type(self).__name__)
        rank = _dist.current().tp_rank
        self.start_index = rank * self.vocab_size_per_partition
        self.end_index = (rank + 1) * self.vocab_size_per_partition
        self.weight = DistributedParameter(
            torch.empty(self.vocab_size_per_partition, embedding_size, dtype=dtype, device="meta"),
            init_method=ParameterInitializer(torch.nn.init.normal_, mean=init_mean, std=init_std),
            tp_mode=True, tp_split_dim=0)

    def forward(self, x: torch.Tensor, projection: bool = False) -> torch.Tensor:
        """The embeddings of the ids ``x`` (whole), or with ``projection`` this rank's vocabulary logits."""
        if projection:
            return OpParallelLinear.apply(x, self.weight, None, True)
        return F.embedding(x, _tp.gather_rows(self.weight))


class Projection(DistributedModule):
    """BMTrain's output projection: the logits of the whole vocabulary, ``x Wᵀ`` with ``W`` of shape
    ``(vocab_size, embedding_size)`` (no tensor parallelism; :class:`VPProjection` is its
    vocabulary-parallel twin, and loads the same state dict).

    Args:
        vocab_size: classes.
        embedding_size: size of each input's last dimension.
        dtype: the weight's dtype (BMTrain's default, ``torch.half``).
        init_mean: the mean of the normal distribution ``bmt.init_parameters`` draws the weight from.
        init_std: its standard deviation.

    Example::

        head = bmt.nn.Projection(32000, 1024, dtype=torch.bfloat16)
        logits = head(h)                                         # (..., 1024) -> (..., 32000)
    """

    def __init__(self, vocab_size: int, embedding_size: int, dtype: torch.dtype = torch.half,
                 init_mean: float = 0.0, init_std: float = 1) -> None:
        super().__init__()
        self.dim_model = embedding_size
        self.vocab_size = vocab_size
        self.weight = DistributedParameter(
            torch.empty(vocab_size, embedding_size, dtype=dtype, device="meta"),
            init_method=ParameterInitializer(torch.nn.init.normal_, mean=init_mean, std=init_std))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The logits of ``x`` over the whole vocabulary."""
        return F.linear(x, self.weight)


class VPProjection(VPEmbedding):
    """BMTrain's vocabulary-parallel projection: this rank's slice of the vocabulary's logits of the whole ``x``.

    Unlike ``VPEmbedding(x, projection=True)``, the input is whole on every rank (as BMTrain's
    ``VPProjection`` takes it); its gradient comes back whole too.

    Example::

        head = bmt.nn.VPProjection(32000, 1024)
        logits = head(h)                                         # (n, ..., 1024) -> (n, ..., 32000 / T)
    """

    def forward(self, x: torch.Tensor, projection: bool = True) -> torch.Tensor:  # type: ignore[override]
        """This rank's vocabulary logits of ``x`` (``projection`` is accepted and ignored)."""
        return OpParallelLinear.apply(x, self.weight, None)
