"""How the NVFP4 GEMMs sum their blocks: ``"emulated"``, ``"scaled_dot"``, ``"fused"``, or ``"auto"``.

All give y = acc * (global and per-row decode scales) with the same float32 epilogue
(``jax_nvfp4.gemm``; ``"fused"`` applies the global scale and the cast in its kernel); they differ in
how the float32 block sums ``acc`` are computed:

- ``"emulated"``: the codes times their E4M3 scales dequantized to bf16 (exact: at most 6
  significant bits), then a bf16 dot with float32 accumulation. Any backend.
- ``"scaled_dot"``: ``lax.scaled_dot`` on the codes bitcast to float4_e2m1fn and the E4M3
  scales, one per 16 values. It lowers to the composite ``xla.scaled_dot``, which XLA's GPU
  compiler turns into a cuDNN block-scaled GEMM (FP4 tensor cores) on Blackwell and
  decomposes into convert, multiply and dot elsewhere (CPU, Hopper).
- ``"fused"``: a Pallas GEMM (``jax_nvfp4.ops.fused_gemm``) that loads the packed codes and E4M3
  scales and decodes them in its tiles (exactly, as ``"emulated"``) for a bf16 dot with float32
  accumulation: no bf16 copy of an operand in memory. For GPUs without FP4 tensor cores (Hopper);
  compiled through Triton on a GPU, run in Pallas's interpret mode elsewhere (slow: for tests).
- ``"auto"``: ``"scaled_dot"`` where ``native_scaled_dot()`` holds, ``"emulated"`` elsewhere.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax

from jax_nvfp4.core.checks import check_choice

GemmImpl = Literal["auto", "emulated", "scaled_dot", "fused"]
GEMM_IMPLS: tuple[GemmImpl, ...] = ("auto", "emulated", "scaled_dot", "fused")

_FP4_TENSOR_CORES_FROM = 10
"""The first CUDA compute capability (major) with FP4 tensor cores: Blackwell (sm_100, sm_120, ...)."""


def _cuda_major(device: jax.Device) -> int:
    """A CUDA device's compute capability major (0 for anything else, ROCm included)."""
    capability = getattr(device, "compute_capability", None)
    if device.platform != "gpu" or not isinstance(capability, str):
        return 0
    major = capability.split(".")[0]
    return int(major) if major.isdigit() else 0


def has_fp4_tensor_cores(devices) -> bool:
    """Whether ``devices`` are all CUDA GPUs of compute capability 10.0 or newer (and there is one)."""
    devices = list(devices)
    return bool(devices) and all(_cuda_major(d) >= _FP4_TENSOR_CORES_FROM for d in devices)


@functools.cache
def native_scaled_dot(backend: str | None = None) -> bool:
    """Whether ``lax.scaled_dot`` of NVFP4 operands runs on FP4 tensor cores on ``backend`` (default: JAX's).

    True when every device of the backend is a CUDA GPU of compute capability 10.0 or newer
    (Blackwell), where XLA's GPU compiler maps the block-scaled dot to cuDNN's NVFP4 GEMM. False on
    CPU, on Hopper (no FP4 tensor cores: XLA decomposes it) and on other GPUs.
    """
    return has_fp4_tensor_cores(jax.devices(backend))


def resolve_impl(impl: GemmImpl, name: str = "impl") -> Literal["emulated", "scaled_dot", "fused"]:
    """``impl`` checked (ValueError naming ``name`` otherwise), with ``"auto"`` decided for the default backend."""
    impl = check_choice(name, impl, GEMM_IMPLS)
    if impl == "auto":
        return "scaled_dot" if native_scaled_dot() else "emulated"
    return impl
