"""The training example's device mesh (``--mesh``): its axes, the logical-axis rules that shard the model on it,
and the parameters and training state placed on it.

The batch splits over data x fsdp, the parameters and their optimizer state over fsdp (gathered for use), and the
attention heads and MLP over tensor.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from examples.lm.data import EVAL_BATCH

MESH_AXES = ("data", "fsdp", "tensor")
BATCH = ("data", "fsdp")  # the mesh axes that split the batch
# Logical axis names -> mesh axes. Parameters' "embed" is sharded over fsdp and gathered where used;
# activations name their model axis "act_embed" so that it stays whole. The vocabulary (256) is small:
# replicated. Without --mesh the annotations do nothing.
RULES = (
    ("batch", BATCH),
    ("embed", "fsdp"),
    ("act_embed", None),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", None),
    ("length", None),
    ("kv", None),
)


def parse_mesh(text: str) -> dict[str, int]:
    """``data=2,fsdp=2,tensor=2`` -> sizes of all of MESH_AXES (those not named: 1), for argparse."""
    sizes, named = dict.fromkeys(MESH_AXES, 1), set()
    for item in text.split(","):
        name, _, size = (part.strip() for part in item.partition("="))
        if name not in MESH_AXES or name in named or not size.isdigit() or int(size) < 1:
            raise argparse.ArgumentTypeError(
                f"{item!r} in {text!r}: expected AXIS=SIZE,... with each AXIS at most once, one of "
                + "/".join(MESH_AXES)
            )
        sizes[name] = int(size)
        named.add(name)
    return sizes


def mesh_name(sizes: dict[str, int] | None) -> str | None:
    return None if sizes is None else ",".join(f"{k}={v}" for k, v in sizes.items())


def make_mesh(sizes: dict[str, int], args: argparse.Namespace) -> jax.sharding.Mesh:
    """The mesh of these axis sizes over all the devices; ValueError if they do not fit the devices or the model."""
    n = math.prod(sizes.values())
    if n != jax.device_count():
        cpu = f" (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count={n} makes {n})"
        raise ValueError(
            f"needs {n} devices, found {jax.device_count()}{cpu if jax.default_backend() == 'cpu' else ''}"
        )
    from examples.lm.model import kv_heads  # here: the model imports this module's RULES

    batch_ways = sizes["data"] * sizes["fsdp"]
    if (
        args.batch % batch_ways
        or EVAL_BATCH % batch_ways
        or args.d_model % sizes["fsdp"]
        or args.heads % sizes["tensor"]
        or kv_heads(args) % sizes["tensor"]
    ):
        raise ValueError(
            f"--batch and the eval batch ({EVAL_BATCH}) must be multiples of data*fsdp, --d-model of fsdp, "
            "--heads and --kv-heads of tensor"
        )
    # Auto axes (make_mesh defaults to Explicit): jit and the library's partitioning rules place the intermediates.
    return jax.make_mesh(
        tuple(sizes.values()), MESH_AXES, (jax.sharding.AxisType.Auto,) * len(sizes), devices=jax.devices()[:n]
    )


def sharded_params(init: Callable[[], Any], mesh: jax.sharding.Mesh) -> Any:
    """The unboxed parameters from ``init``, made by a jitted init directly in the shards their logical axes
    name, so no device ever holds them all."""
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(jax.eval_shape(init)), mesh, RULES)
    return jax.jit(lambda: nn.unbox(init()), out_shardings=shardings)()


def shard_state(state: train_state.TrainState, mesh: jax.sharding.Mesh) -> tuple[train_state.TrainState, Any]:
    """The state committed to the mesh, its arrays sharded as they are (the params and, following them, their
    optimizer moments) and the rest replicated (step counts); and those shardings, to pin the train step's
    output to (jit picks equivalent but unequal ones, so the second step would compile again)."""
    replicated = NamedSharding(mesh, P())
    sharding = lambda a: a.sharding if isinstance(getattr(a, "sharding", None), NamedSharding) else replicated  # noqa: E731
    shardings = jax.tree.map(sharding, state)
    return jax.device_put(state, shardings), shardings
