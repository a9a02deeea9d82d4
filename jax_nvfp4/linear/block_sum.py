"""How the NVFP4 GEMMs sum their blocks: ``"emulated"``, ``"scaled_dot"``, ``"cudnn"``, ``"fused"``, or ``"auto"``.

All give y = acc * (global and per-row decode scales) with the same float32 epilogue
(``jax_nvfp4.gemm``); they differ in how the float32 block sums ``acc`` are computed:

- ``"emulated"``: the codes times their E4M3 scales dequantized to bf16 (exact: at most 6
  significant bits), then a bf16 dot with float32 accumulation. Any backend.
- ``"scaled_dot"``: ``lax.scaled_dot`` on the codes bitcast to float4_e2m1fn and the E4M3
  scales, one per 16 values. XLA's GPU compiler makes it a Triton GEMM on Blackwell whose MMA is
  ``tcgen05.mma ... kind::mxf4nvf4.block_scale`` (FP4 tensor cores), with the global scale and the
  output cast in its epilogue; elsewhere (CPU, Hopper) it decomposes into convert, multiply and dot.
- ``"cudnn"``: ``jax.nn.scaled_matmul``, cuDNN's block-scaled GEMM on Blackwell (FP4 tensor cores too),
  which writes a float32 result that a second pass scales and casts, after a pass that swizzles each
  operand's scales to cuDNN's layout. Off the GPU it lowers as ``"scaled_dot"`` (the same sum).
- ``"fused"``: a Pallas GEMM (``jax_nvfp4.ops.fused_gemm``) that loads the packed codes and E4M3
  scales and decodes them in its tiles (exactly, as ``"emulated"``) for a bf16 dot with float32
  accumulation, and applies the global scale and the cast itself: no bf16 copy of an operand in
  memory. For GPUs without FP4 tensor cores (Hopper); compiled through Triton on a GPU, run in
  Pallas's interpret mode elsewhere (slow: for tests).
- ``"auto"``: ``"scaled_dot"`` where the devices the GEMM is compiled for all have FP4 tensor cores,
  ``"emulated"`` elsewhere. The GEMM primitive decides while it is lowered, from the devices of the
  compilation (a jit's device assignment, an AOT compile for a compile-only target, a mesh), so that
  what XLA compiles for decides, not the devices this process sees.
"""

from __future__ import annotations

from typing import Literal

import jax

from jax_nvfp4.core.checks import check_choice

GemmImpl = Literal["auto", "emulated", "scaled_dot", "cudnn", "fused"]
GEMM_IMPLS: tuple[GemmImpl, ...] = ("auto", "emulated", "scaled_dot", "cudnn", "fused")

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


def target_devices() -> list:
    """The devices a computation traced now is compiled for, as far as tracing knows: the concrete mesh in
    context (``jax.set_mesh``, ``with mesh:``), else JAX's default backend's."""
    from jax._src import mesh as mesh_lib  # no public getter of the concrete mesh inside a trace

    mesh = mesh_lib.get_concrete_mesh() if hasattr(mesh_lib, "get_concrete_mesh") else None
    if mesh is None or mesh.empty:  # ``with mesh:``
        mesh = mesh_lib.thread_resources.env.physical_mesh
    return list(mesh.devices.flat) if not mesh.empty else jax.devices()


def native_scaled_dot(devices=None) -> bool:
    """Whether ``lax.scaled_dot`` of NVFP4 operands runs on FP4 tensor cores on ``devices`` (default:
    ``target_devices()``).

    True when every device is a CUDA GPU of compute capability 10.0 or newer (Blackwell), where XLA's GPU
    compiler maps the block-scaled dot to an FP4 tensor-core GEMM. False on CPU, on Hopper (no FP4 tensor
    cores: XLA decomposes it) and on other GPUs.
    """
    return has_fp4_tensor_cores(target_devices() if devices is None else devices)


def check_impl(impl: GemmImpl, name: str = "impl") -> GemmImpl:
    """``impl``, checked: a ValueError naming ``name`` otherwise."""
    return check_choice(name, impl, GEMM_IMPLS)


def resolve_impl(
    impl: GemmImpl, name: str = "impl", devices=None
) -> Literal["emulated", "scaled_dot", "cudnn", "fused"]:
    """``impl`` checked, with ``"auto"`` decided for ``devices`` (default: ``target_devices()``)."""
    impl = check_impl(impl, name)
    if impl == "auto":
        return "scaled_dot" if native_scaled_dot(devices) else "emulated"
    return impl
