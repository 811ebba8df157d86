"""Checks of arguments, shared by the ops, the references, rope, weights, parallel and the planner.

The scalar checks return the value as a plain Python int or float; ``tensor`` checks a tensor
argument and returns it. Each raises a TypeError (not a number of that kind, not a tensor, a wrong
dtype) or a ValueError (out of range, a wrong shape or layout) whose message starts with the
argument's name.
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


def tensor(name: str, t, *, dims: Optional[int] = None, last: Optional[int] = None, dtype=None, dtypes=None,
           last_contiguous: bool = False, contiguous: bool = False) -> torch.Tensor:
    """A torch.Tensor with ``dims`` dims, a last dim of size ``last``, dtype ``dtype`` (or one of
    ``dtypes``), contiguous or with a contiguous last dim, as asked (None / False: anything)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{name}: expected {dims} dims, got shape {tuple(t.shape)}")
    if last is not None and t.shape[-1] != last:
        raise ValueError(f"{name}: the last dim must be {last}, got shape {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name}: dtype must be one of {', '.join(map(str, dtypes))}, got {t.dtype}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (got strides {t.stride()})")
    if last_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dim must be contiguous (got strides {t.stride()})")
    return t
