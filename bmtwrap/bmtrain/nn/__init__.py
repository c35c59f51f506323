"""BMTrain's ``bmt.nn`` layers: :class:`Linear` and :class:`OpLinear`.

The tensor-parallel layers BMTrain also lists (``ColumnParallelLinear``, ``RowParallelLinear``,
``VPEmbedding``, ``OpParallelLinear``) exist by name and raise ``NotImplementedError``: bmtwrap
shards with ZeRO over all ranks and has no tensor parallelism.
"""

from .linear import Linear, OpLinear
from .parallel import ColumnParallelLinear, OpParallelLinear, RowParallelLinear, VPEmbedding

__all__ = ["ColumnParallelLinear", "Linear", "OpLinear", "OpParallelLinear", "RowParallelLinear", "VPEmbedding"]
