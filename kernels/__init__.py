"""Attention kernels for the P-EAGLE pattern (and plain causal / sliding-window attention).

    from kernels import AttentionSpec, attention
    spec = AttentionSpec.peagle(anchor, depth, doc)          # [B, T] int32 each
    out = attention(q, k, v, spec)                           # q [B,T,Hq,D], k/v [B,T,Hkv,D]

Backends: ``kernels.xla`` (blockwise pure JAX, every platform), ``kernels.gpu`` (Pallas,
Triton lowering), ``kernels.tpu`` (Pallas, Mosaic TPU), ``kernels.reference`` (dense, the
truth for tests). Block schedules (``kernels.schedule``) are computed inside jit from the
per-row metadata. ``kernels.layouts.cod_layout`` builds COD row layouts for tests/benches.
``kernels.slot_attention`` is the same rule over COD rows whose deeper rows share one input
(the drafter's first layer): the mask slot's query is attended once per position.
This package depends on nothing else in the project.
"""

from . import chain, decode, dense, layouts, mask_slot, reference, schedule
from .api import DENSE_MAX_ROWS, attention, for_platform, platform, resolve_backend
from .mask_slot import slot_attention
from .partition import partitioned
from .schedule import BlockSchedule, make_schedule
from .spec import AttentionSpec, visible

__all__ = [
    "chain",
    "decode",
    "dense",
    "AttentionSpec",
    "attention",
    "DENSE_MAX_ROWS",
    "resolve_backend",
    "platform",
    "for_platform",
    "partitioned",
    "visible",
    "BlockSchedule",
    "make_schedule",
    "reference",
    "schedule",
    "mask_slot",
    "slot_attention",
    "layouts",
]
