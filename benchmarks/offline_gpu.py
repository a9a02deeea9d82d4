"""Compile for a Hopper or Blackwell GPU on a machine without one: XLA's GPU compiler run deviceless (ahead of time).

The CUDA PJRT plugin (``pip install jax-cuda13-plugin jax-cuda13-pjrt`` at jax's version; no GPU, driver or
cuDNN needed) compiles for a target described by a ``GpuTargetConfigProto`` instead of an attached device.
What comes out is the program XLA would run on that GPU (its fusions, Triton GEMMs, custom calls), minus
autotuning: tile sizes are XLA's defaults, not the ones a GPU run picks. Pallas's Triton lowering reads the
target from an abstract mesh's device. Nothing runs; use it to read programs, not to time them.

``TARGETS`` describes each GPU by NVIDIA's published figures. XLA reads the cuDNN version only from
``gpu_device_info.dnn_version``: without it (or below 9.10), it expands ``jax.nn.scaled_matmul`` into a
dequantize and a bf16 dot instead of calling cuDNN's NVFP4 GEMM, so the targets carry the version that the
plugin's CUDA extra installs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os

import jax

H100 = "NVIDIA H100 80GB HBM3"
H200 = "NVIDIA H200"
B200 = "NVIDIA B200"

CUDNN_VERSION = "9.12.0"
"""The cuDNN that ``jax-cuda13-plugin[with-cuda]`` 0.12 asks for (nvidia-cudnn-cu13 >= 9.12.0.46)."""


@dataclasses.dataclass(frozen=True)
class Target:
    """A GPU as XLA's compiler reads it, and the published peaks that ``benchmarks.roofline`` models it by."""

    name: str
    device_kind: str
    capability: tuple[int, int]
    sms: int
    l2_bytes: int
    memory_bytes: int
    clock_ghz: float
    hbm_bytes_per_s: float
    bf16_flops: float  # dense tensor-core peaks, FLOP/s
    fp8_flops: float
    fp4_flops: float  # 0: no FP4 tensor cores
    source: str

    @property
    def config(self) -> str:
        """The ``GpuTargetConfigProto`` text XLA compiles for."""
        major, minor = self.capability
        return f"""
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  shared_memory_per_block_optin: 232448
  threads_per_core_limit: 2048
  core_count: {self.sms}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(self.hbm_bytes_per_s)}
  l2_cache_size: {self.l2_bytes}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {self.memory_bytes}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  dnn_version: "{CUDNN_VERSION}"
}}
platform_name: "CUDA"
device_description_str: "{self.device_kind}"
"""

    @property
    def abstract_mesh(self) -> jax.sharding.AbstractMesh:
        """A one-device mesh of this GPU: Pallas's Triton lowering reads the target from it (under
        ``jax.sharding.use_abstract_mesh``) where no GPU is attached. Needs no plugin."""
        device = jax.sharding.AbstractDevice(device_kind=self.device_kind, num_cores=self.sms, platform="gpu")
        return jax.sharding.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=device)


TARGETS = {
    # H100 SXM5: 132 SMs with 228 KB of shared memory each (227 KB for one block), 50 MB L2, 80 GB HBM3.
    "h100": Target(
        "h100", H100, (9, 0), 132, 50 * 2**20, 84942979072, 1.98, 3.35e12, 989.4e12, 1978.9e12, 0.0,
        "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: 3.35 TB/s HBM3; dense BF16 989.4, FP8 1,978.9 TFLOPS",
    ),
    # H200 SXM: an H100's SMs and caches with 141 GB of HBM3e.
    "h200": Target(
        "h200", H200, (9, 0), 132, 50 * 2**20, 151397597184, 1.98, 4.8e12, 989.4e12, 1978.9e12, 0.0,
        "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: 4.8 TB/s HBM3e; dense BF16 989.4, FP8 1,978.9 TFLOPS",
    ),
    # B200 (HGX, 1,000 W): 148 SMs, the same 228 KB of shared memory a SM, 126 MB L2, 180 GB HBM3e. A GB200's
    # GPUs are B200s (the same SMs and compute capability 10.0); only their clocks and peaks are higher.
    "b200": Target(
        "b200", B200, (10, 0), 148, 126 * 2**20, 193273528320, 1.965, 8.0e12, 2.25e15, 4.5e15, 9.0e15,
        "NVIDIA HGX B200 datasheet, per GPU: 8 TB/s HBM3e; dense BF16 2.25, FP8 4.5, FP4 9 PFLOPS (half the "
        "sparse figures)",
    ),
}  # fmt: skip


def target_of(device_kind: str) -> Target | None:
    """The target whose device kind ``device_kind`` is (an attached GPU's ``device_kind``), or None."""
    return next((t for t in TARGETS.values() if device_kind.startswith(t.device_kind)), None)


def plugin_installed() -> bool:
    """Whether jax's CUDA 13 plugin is importable (it needs no GPU)."""
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda13") is not None
    except ModuleNotFoundError:  # no jax_plugins package at all
        return False


def _install_hint() -> str:
    v = jax.__version__
    plugins = f"jax-cuda13-plugin=={v} jax-cuda13-pjrt=={v}"
    return f"compiling for a GPU without one needs jax's CUDA plugin: pip install {plugins}"


def prepare() -> None:
    """Call before JAX starts its backends (before the first array): the CUDA plugin then registers without
    checking for cuDNN and a driver, which a compile-only target does not use. RuntimeError without the plugin."""
    from jax._src import xla_bridge

    if not plugin_installed():
        raise RuntimeError(_install_hint())
    if xla_bridge.backends_are_initialized() and "cuda" not in xla_bridge._topology_factories:
        raise RuntimeError("benchmarks.offline_gpu.prepare() must run before JAX's first array or device query")
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


def target(name: str) -> Target:
    """``TARGETS[name]``, or a ValueError listing the targets."""
    if name not in TARGETS:
        raise ValueError(f"no offline GPU target {name!r}: one of {', '.join(TARGETS)}")
    return TARGETS[name]


def devices(name: str = "h100") -> list:
    """One compile-only device of target ``name`` (its ``compute_capability`` is the target's). RuntimeError where
    the CUDA plugin is not installed."""
    t = target(name)
    prepare()
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(
            platform="cuda", topology_name=name, target_config=t.config, topology="1x1x1"
        )
    except (NotImplementedError, RuntimeError) as e:
        raise RuntimeError(f"{_install_hint()} ({e})") from e
    return list(topology.devices)


@contextlib.contextmanager
def compile_for(name: str = "h100"):
    """``with compile_for("b200") as on_gpu:`` lower and compile for that compile-only GPU inside, with arguments
    ``on_gpu(shape, dtype)`` (``jit(f).trace(*args).lower().compile()``); Pallas's Triton lowering targets it."""
    mesh = jax.sharding.Mesh(devices(name), ("x",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def on_gpu(shape, dtype) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)

    with jax.sharding.use_abstract_mesh(target(name).abstract_mesh):
        yield on_gpu
