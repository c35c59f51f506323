"""Saving and loading sharded models."""

from .full import load, load_state_dict, save

__all__ = ["load", "load_state_dict", "save"]
