"""The GPU classes the kernel variants serve, and the shared-memory limits a launch plans for.

The table itself lives in the C++ core (csrc/include/mla_kv/arch.h, ``kGpuClasses``): every tile
configuration is asserted at compile time against the class it is meant for, and the attention launch
picks its tiles from the device's limits. Passing a class (or explicit limits) as ``smem_limits`` to
:func:`mla_kv.attention_schedule` makes a larger GPU run the configuration that class would get, so
the GPU tests on an H200 run what a V100, a T4, an A10 / L40 or an A100 runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple, Union

from ._compiled import _C


@dataclass(frozen=True)
class SmemLimits:
    """Shared memory per CTA (the opt-in maximum), per SM, and what the driver keeps of each
    resident CTA's share (1 KB on sm80+), in bytes."""

    per_block: int
    per_sm: int
    reserved_per_block: int = 0


@dataclass(frozen=True)
class GpuClass:
    name: str
    arch: str  # the kernel variant that runs there ("sm70", ...)
    smem: SmemLimits


@dataclass(frozen=True)
class AttentionTiles:
    """The tile configuration an attention launch takes (mla_kv._C.attention_tiles)."""

    block_m: int      # query rows (token, head) per CTA
    block_n: int      # cache rows per tile
    stages: int       # tiles in flight: 1 = the next one staged in registers, 2-3 = a cp.async ring
    smem_bytes: int   # dynamic shared memory per CTA
    ctas_per_sm: int  # resident CTAs per SM the split schedule counts

    @classmethod
    def from_c(cls, t) -> "AttentionTiles":
        return cls(t.block_m, t.block_n, t.stages, t.smem_bytes, t.ctas_per_sm)


def gpu_classes() -> Dict[str, GpuClass]:
    """name -> GpuClass, from the compiled core ({} in a reference-only install)."""
    if _C is None:
        return {}
    return {name: GpuClass(name, tag.name, SmemLimits(l.per_block, l.per_sm, l.reserved_per_block))
            for name, tag, l in _C.gpu_classes}


LimitsSpec = Union[None, str, SmemLimits, Tuple[int, int], Tuple[int, int, int]]


def smem_limits(spec: LimitsSpec, name: str = "smem_limits") -> Optional[SmemLimits]:
    """A GPU class name (see gpu_classes()), SmemLimits or a (per_block, per_sm[, reserved]) tuple of
    byte counts -> SmemLimits; None stays None (the device's own limits)."""
    if spec is None or isinstance(spec, SmemLimits):
        return spec
    if isinstance(spec, str):
        classes = gpu_classes()
        if spec not in classes:
            raise ValueError(f"{name}: unknown GPU class {spec!r}; one of {', '.join(map(repr, classes))}")
        return classes[spec].smem
    if isinstance(spec, tuple) and len(spec) in (2, 3) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in spec):
        if spec[0] <= 0 or spec[1] <= 0 or (len(spec) == 3 and spec[2] < 0):
            raise ValueError(f"{name}: per_block and per_sm must be > 0 and reserved >= 0, got {spec}")
        return SmemLimits(*spec)
    raise ValueError(f"{name}: expected a GPU class name, SmemLimits or (per_block, per_sm[, reserved]) "
                     f"bytes, got {spec!r}")


def c_limits(limits: Optional[SmemLimits]):
    """The _C.SmemLimits of a launch (all zeros: the device's)."""
    if limits is None:
        return _C.SmemLimits()
    return _C.SmemLimits(limits.per_block, limits.per_sm, limits.reserved_per_block)
