"""Compile for a Hopper GPU on a machine without one: XLA's GPU compiler run deviceless (ahead of time).

The CUDA PJRT plugin (``pip install jax-cuda13-plugin jax-cuda13-pjrt`` at jax's version; no GPU, driver or
cuDNN needed) compiles for a target described by a ``GpuTargetConfigProto`` instead of an attached device.
What comes out is the program XLA would run on that GPU (its fusions, Triton GEMMs, custom calls), minus
autotuning: tile sizes are XLA's defaults, not the ones a GPU run picks. Pallas's Triton lowering reads the
target from an abstract mesh's device. Nothing runs; use it to read programs, not to time them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os

import jax

H100 = "NVIDIA H100 80GB HBM3"

# NVIDIA's published H100 SXM figures: 132 SMs, 228 KB of shared memory each (227 KB for one block),
# 50 MB L2, 80 GB HBM3 at 3.35 TB/s, 1.98 GHz boost.
_H100_TARGET = f"""
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  shared_memory_per_block_optin: 232448
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84942979072
  cuda_compute_capability {{ major: 9 }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 }}
device_description_str: "{H100}"
"""


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


HOPPER_MESH = jax.sharding.AbstractMesh(
    (1,),
    ("x",),
    axis_types=(jax.sharding.AxisType.Auto,),
    abstract_device=jax.sharding.AbstractDevice(device_kind=H100, num_cores=132, platform="gpu"),
)
"""An abstract one-device H100 mesh: Pallas's Triton lowering reads the target GPU from it (under
``jax.sharding.use_abstract_mesh``) where no GPU is attached. Needs no plugin."""


def hopper_devices() -> list:
    """One compile-only H100 (sm_90) device. Raises RuntimeError where the CUDA plugin is not installed."""
    prepare()
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(
            platform="cuda", topology_name="h100", target_config=_H100_TARGET, topology="1x1x1"
        )
    except (NotImplementedError, RuntimeError) as e:
        raise RuntimeError(f"{_install_hint()} ({e})") from e
    return list(topology.devices)


@contextlib.contextmanager
def hopper():
    """``with hopper() as on_h100:`` lower and compile for the compile-only H100 inside, with arguments
    ``on_h100(shape, dtype)`` (``jit(f).trace(*args).lower().compile()``); Pallas's Triton lowering targets sm_90."""
    mesh = jax.sharding.Mesh(hopper_devices(), ("x",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def on_h100(shape, dtype) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)

    with jax.sharding.use_abstract_mesh(HOPPER_MESH):
        yield on_h100
