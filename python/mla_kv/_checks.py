"""Checks of scalar arguments, shared by the ops, the references, rope, weights and the planner.

Each returns the value as a plain Python int or float, or raises a TypeError (not a number of that
kind) or a ValueError (out of range) whose message starts with the argument's name.
"""
from __future__ import annotations

import math
import numbers
import operator
from typing import Optional

import torch

_COMPARE = {">": operator.gt, ">=": operator.ge, "<=": operator.le}


def integer(name: str, value, minimum: int) -> int:
    """An integer >= minimum: a Python or numpy int (bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")
    return int(value)


def real(name: str, value, *, above: Optional[float] = None, at_least: Optional[float] = None,
         at_most: Optional[float] = None) -> float:
    """A finite real number within the bounds given, as a float.

    Python and numpy numbers are accepted, and 0-d tensors on the CPU. A tensor on another device is
    refused: reading it would synchronize the host with the device (and fail in CUDA graph capture).
    """
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype == torch.bool or value.dtype.is_complex:
            raise TypeError(f"{name}: expected a real number, got a {value.dtype} tensor of shape "
                            f"{tuple(value.shape)}")
        if value.device.type != "cpu":
            raise TypeError(f"{name}: got a tensor on {value.device}; reading it would synchronize with the "
                            "device: pass a Python float (or a CPU tensor)")
        value = value.item()
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:
        raise ValueError(f"{name}: must be finite, got an int beyond float range") from None
    if not math.isfinite(number):
        raise ValueError(f"{name}: must be finite, got {number}")
    limits = [(op, bound) for op, bound in ((">", above), (">=", at_least), ("<=", at_most)) if bound is not None]
    if not all(_COMPARE[op](number, bound) for op, bound in limits):
        need = " and ".join(f"{op} {bound}" for op, bound in limits)
        raise ValueError(f"{name}: must be {need}, got {number!r}")
    return number
