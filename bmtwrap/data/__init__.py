"""Data for fine-tuning: packing many short examples into full rows without cross-talk (``packing.py``)."""

from .packing import PACKING_FAMILIES, PackedBatch, Packer, PaddingShare, check_packing, first_fit_decreasing

__all__ = ["PACKING_FAMILIES", "PackedBatch", "Packer", "PaddingShare", "check_packing", "first_fit_decreasing"]
