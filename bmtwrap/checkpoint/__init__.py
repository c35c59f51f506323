"""Saving and loading sharded models."""

from .full import load_state_dict

__all__ = ["load_state_dict"]
