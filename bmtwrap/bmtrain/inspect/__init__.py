"""``bmt.inspect``: statistics of parameters, gradients and recorded activations (BMTrain's module).

Each summary is a list of dicts with BMTrain's keys ``name``, ``shape``, ``max``, ``min``,
``std``, ``mean``, ``grad_std``, ``grad_mean`` (``None`` where there is no gradient), and
:func:`format_summary` prints them as BMTrain's table.
"""

from .format import format_summary
from .model import inspect_model
from .tensor import InspectTensor, inspect_tensor, record_tensor

__all__ = ["InspectTensor", "format_summary", "inspect_model", "inspect_tensor", "record_tensor"]
