"""bmtwrap: ZeRO-sharded, activation-checkpointed training of PyTorch models on many GPUs.

Public names only; see each one's docstring. A BMTrain program runs after ``import bmtwrap as bmt``.
"""

from . import optim
from .block import Block, CheckpointBlock
from .blocklist import TransformerBlockList
from .dist import init_distributed, print_rank, rank, sum_loss, synchronize, world_size
from .module import DistributedModule, full_state_dict, init_parameters
from .param import DistributedParameter

__version__ = "0.1.0"

__all__ = [
    "Block",
    "CheckpointBlock",
    "DistributedModule",
    "DistributedParameter",
    "TransformerBlockList",
    "full_state_dict",
    "init_distributed",
    "init_parameters",
    "optim",
    "print_rank",
    "rank",
    "sum_loss",
    "synchronize",
    "world_size",
]
