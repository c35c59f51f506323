"""bmtwrap: ZeRO-sharded, activation-checkpointed training of PyTorch models on many GPUs.

Public names only; see each one's docstring. A BMTrain program runs after ``import bmtwrap as bmt``.
"""

from . import loss, lr_scheduler, optim
from .block import Block, CheckpointBlock
from .blocklist import TransformerBlockList
from .checkpoint import (CheckpointInfo, from_pretrained, load, load_checkpoint, load_pretrained, load_state_dict, save,
                         save_checkpoint, save_pretrained)
from .dist import init_distributed, print_rank, rank, sum_loss, synchronize, world_size
from .module import DistributedModule, full_grad_dict, full_state_dict, init_parameters
from .param import DistributedParameter
from .wrap import WrapPlan, materialize, plan, wrap

BMTrainModelWrapper = wrap
"""BMTrain's name of :func:`wrap` (the same function)."""

__version__ = "0.1.0"

__all__ = [
    "Block",
    "BMTrainModelWrapper",
    "CheckpointBlock",
    "CheckpointInfo",
    "DistributedModule",
    "DistributedParameter",
    "from_pretrained",
    "full_grad_dict",
    "full_state_dict",
    "init_distributed",
    "init_parameters",
    "load",
    "load_checkpoint",
    "load_pretrained",
    "load_state_dict",
    "loss",
    "lr_scheduler",
    "materialize",
    "optim",
    "plan",
    "print_rank",
    "rank",
    "save",
    "save_checkpoint",
    "save_pretrained",
    "sum_loss",
    "synchronize",
    "TransformerBlockList",
    "world_size",
    "wrap",
    "WrapPlan",
]
