"""BMTrain's tensor-parallel layers, which bmtwrap does not provide.

BMTrain 1.0.1 builds these only with ``init_distributed(tp_size>1)`` (their parameters need the
tensor-parallel communicator; with ``tp_size == 1`` they fail at construction there too). bmtwrap
shards every parameter over all ranks with ZeRO instead and refuses ``tp_size > 1``, so each name
raises ``NotImplementedError`` naming the layer to use.
"""

from __future__ import annotations

from typing import Any, NoReturn

__all__ = ["ColumnParallelLinear", "OpParallelLinear", "RowParallelLinear", "VPEmbedding"]


def _refuse(name: str, instead: str) -> NoReturn:
    raise NotImplementedError(
        f"bmt.nn.{name} is BMTrain's tensor-parallel layer; bmtwrap has no tensor parallelism (it shards every "
        f"parameter over all ranks with ZeRO instead): use {instead}"
    )


class ColumnParallelLinear:
    """BMTrain's column-parallel linear layer: raises ``NotImplementedError``
    (use :class:`~bmtwrap.bmtrain.nn.Linear`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _refuse("ColumnParallelLinear", "bmt.nn.Linear(in_features, out_features)")


class RowParallelLinear:
    """BMTrain's row-parallel linear layer: raises ``NotImplementedError`` (use :class:`~bmtwrap.bmtrain.nn.Linear`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _refuse("RowParallelLinear", "bmt.nn.Linear(in_features, out_features)")


class VPEmbedding:
    """BMTrain's vocabulary-parallel embedding: raises ``NotImplementedError`` (use ``torch.nn.Embedding``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _refuse("VPEmbedding", "torch.nn.Embedding (in a bmt.DistributedModule or a wrapped model)")


class OpParallelLinear:
    """BMTrain's tensor-parallel linear function: ``apply`` raises ``NotImplementedError``."""

    @staticmethod
    def apply(*args: Any, **kwargs: Any) -> NoReturn:
        """Raises ``NotImplementedError``; use :class:`~bmtwrap.bmtrain.nn.OpLinear`."""
        _refuse("OpParallelLinear", "bmt.nn.OpLinear.apply(x, weight, bias)")
