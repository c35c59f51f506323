"""Saving and loading sharded models: full files, sharded checkpoints, Hugging Face folders."""

from .full import load, load_state_dict, save
from .pieces import clean
from .hf import from_pretrained, load_pretrained, save_pretrained
from .sharded import CheckpointInfo, load_checkpoint, save_checkpoint

__all__ = ["CheckpointInfo", "clean", "from_pretrained", "load", "load_checkpoint", "load_pretrained",
           "load_state_dict", "save", "save_checkpoint", "save_pretrained"]
