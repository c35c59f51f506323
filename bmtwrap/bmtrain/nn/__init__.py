"""BMTrain's ``bmt.nn`` layers: :class:`Linear` and :class:`OpLinear`, and the tensor-parallel
:class:`ColumnParallelLinear`, :class:`RowParallelLinear`, :class:`VPEmbedding`, :class:`VPProjection`
and :class:`OpParallelLinear` (``init_distributed(tp_size=...)``), with :class:`Projection`, the
vocabulary projection without tensor parallelism.
"""

from .linear import Linear, OpLinear
from .parallel import (ColumnParallelLinear, OpParallelLinear, Projection, ReduceType, RowParallelLinear, VPEmbedding,
                       VPProjection)

__all__ = ["ColumnParallelLinear", "Linear", "OpLinear", "OpParallelLinear", "Projection", "ReduceType",
           "RowParallelLinear", "VPEmbedding", "VPProjection"]
