"""``nvfp4_dequantize``: data [B, M, ceil(N/2)], scale [B, M, ceil(N/16)], amax [B] or per row [B, M]
-> [B, M, cols] of ``dtype``: fp32(E2M1 * scale) * fp32(amax / (6 E)), E = ``e4m3_max``.
"""

from __future__ import annotations

import numpy as np

from jax_nvfp4.core.formats import BLOCK
from jax_nvfp4.core.spec import E4M3_MAX_CHOICES
from jax_nvfp4.ops.define import Partitioning, define, shaped
from jax_nvfp4.ops.partition import Factors, fits, mesh_size
from jax_nvfp4.reference import kernels


def abstract(data, scale, amax, *, cols, dtype, e4m3_max):
    del scale
    if amax.shape not in (data.shape[:1], data.shape[:2]):
        raise ValueError(f"dequantize amax must be [B] or per row [B, M], got {amax.shape} for data {data.shape}")
    if e4m3_max not in E4M3_MAX_CHOICES:
        raise ValueError(f"e4m3_max must be 448 or 256, got {e4m3_max!r}")
    return (shaped((*data.shape[:2], cols), dtype),)


def _rule(axis_sizes, in_shapes, out_shapes, *, cols, dtype, e4m3_max):
    f = Factors(axis_sizes)
    nv, np_, ns = f.dim("n", cols, blocked=True)
    amax = "b m" if len(in_shapes[2]) == 2 else "b"
    return f.rule(f"b m {np_}, b m {ns}, {amax} -> b m {nv}")


def _partition(mesh, in_dims, out_dims, in_shapes, kernel, *, cols, dtype, e4m3_max):
    (bsz, m, _), (b, dm, dn) = in_shapes[0], in_dims[0]
    b, dm, dn = fits(mesh, bsz, b), fits(mesh, m, dm), fits(mesh, cols, dn, BLOCK)
    local_cols = cols // mesh_size(mesh, dn)
    amax = (b, dm) if len(in_shapes[2]) == 2 else (b,)
    return [(b, dm, dn)] * 2 + [amax], [(b, dm, dn)], lambda *a: kernel(*a, cols=local_cols)


dequantize_p = define(
    "nvfp4_dequantize",
    abstract_eval=abstract,
    reference=lambda *a, **p: (kernels.dequantize_core(*a, **p),),
    partitioning=Partitioning(_rule, _partition),
    ffi_attrs=lambda *, cols, dtype, e4m3_max: {"e4m3_max": np.int32(e4m3_max)},
)


def dequantize(data, scale, amax, *, cols: int, dtype, e4m3_max: int = 448):
    """The kernel backend's dequantize (see ``core.backend.Backend``)."""
    return dequantize_p.bind(data, scale, amax, cols=cols, dtype=dtype, e4m3_max=int(e4m3_max))[0]
