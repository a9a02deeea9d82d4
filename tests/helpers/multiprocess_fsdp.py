"""The training example's FSDP training step (``examples.lm.training``, the full NVFP4 recipe) on a mesh of 8 CPU
devices, in one process or as one of two ``jax.distributed`` processes of 4 devices each: what
tests/multiprocess/ compares.

Run as a script it is one of the two processes (tests/multiprocess/ launches them with
``examples.lm.distributed.launch``)::

    python tests/helpers/multiprocess_fsdp.py PROCESS_ID COORDINATOR OUT_DIR

It joins the job, trains, saves the quantized parameters (still sharded over both processes) with
``jax_nvfp4.checkpoint`` to OUT_DIR/checkpoint from both processes, restores them in both, and pickles what it
found to OUT_DIR/process<ID>.pkl. It imports neither tests/helpers/ nor anything that touches jax's devices
before joining (``helpers`` does, at import).
"""

from __future__ import annotations

import functools
import pathlib
import pickle
import sys

import numpy as np

# The repository's root, for ``examples`` (pytest puts it on sys.path; a script gets its own folder).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils

from examples import train_lm
from examples.lm.data import VOCAB
from examples.lm.distributed import join
from examples.lm.mesh import make_mesh
from examples.lm.model import build_model, next_byte_loss
from examples.lm.training import init_state, make_train_step, save_model
from jax_nvfp4 import checkpoint
from jax_nvfp4.flax.linen.layers import quantize_weights
from jax_nvfp4.sharding.hlo import collectives

# A tiny model (one block; d_model 128, so that its 16x16 weight blocks split 8 ways over fsdp as whole ones: 64 would
# split them, and the layers would gather float32 weights), two steps (the first at learning rate 0, the warmup's start:
# the second updates the parameters from gradients of the same parameters in both runs).
FSDP_FLAGS = "--batch 8 --seq-len 32 --d-model 128 --layers 1 --heads 2 --steps 2 --mesh fsdp=8 --runs full"
FSDP_RUN = "full"  # NVIDIA's recipe: RHT and stochastic rounding (its draws are positions in the whole tensor)


def flat_host(tree) -> dict[str, np.ndarray]:
    """The leaves of ``tree`` (arrays sharded over every process's devices, or not) gathered whole to the host,
    by their paths."""
    host = multihost_utils.process_allgather(tree, tiled=True)
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(host)}


def run_fsdp_steps(checkpoint_dir: pathlib.Path | None = None, seed: int = 0) -> dict:
    """Two training steps of the example's model on its mesh (fsdp=8 over ``jax.devices()``: one process's, or
    every process's once joined): the all-gathers of the compiled step, the losses, the parameters, and their
    quantized form (``quantize_weights``, what ``--save`` writes) before and after, all on the host. With
    ``checkpoint_dir``, the quantized tree is saved there as it is sharded (each process writes its shards) and
    restored, and the example's ``--save`` writes the model to ``checkpoint_dir``/saved (gathered to the host)."""
    args = train_lm.make_parser().parse_args([*FSDP_FLAGS.split(), "--seed", str(seed)])
    mesh = make_mesh(args.mesh, args)
    model = build_model(FSDP_RUN, args, mesh)
    state, jit_step, put = init_state(model, args, mesh)
    loss_fn = functools.partial(next_byte_loss, model)
    step, _ = make_train_step(loss_fn, rounding_key=jax.random.key(args.seed + 1), jit_step=jit_step)
    # The same batches on every process (put gives each its devices' rows).
    batches = np.random.default_rng(seed).integers(0, VOCAB, (args.steps, args.batch, args.seq_len + 1), np.int32)
    compiled = step.lower(state, put(batches[0])).compile()
    tokens = (jnp.zeros((1, args.seq_len), jnp.int32),)
    quantized_init = flat_host(quantize_weights(state.params, model=model, inputs=tokens))  # the step donates state
    # The gradients of the first batch at the initial parameters (the step's own are not kept: it applies them).
    grads = flat_host(jax.jit(jax.grad(loss_fn))(state.params, put(batches[0]), jax.random.key(args.seed + 1)))
    gathers = [(c.dtype, c.op_name) for c in collectives(compiled.as_text()) if c.op == "all-gather"]
    losses = []
    for batch in batches:
        state, loss = compiled(state, put(batch))
        losses.append(float(loss))  # replicated: every process reads it
    quantized = quantize_weights(state.params, model=model, inputs=tokens)
    result = {
        "processes": jax.process_count(),
        "devices": jax.device_count(),
        "gathers": gathers,
        "losses": losses,
        "grads": grads,
        "params": flat_host(state.params),
        "quantized_init": quantized_init,
        "quantized": flat_host(quantized),
    }
    if checkpoint_dir is not None:
        checkpoint.save(checkpoint_dir, quantized)
        restored = checkpoint.restore(checkpoint_dir)
        result["restored"] = flat_host(restored)
        save_model(checkpoint_dir / "saved", FSDP_RUN, args, model, state.params)
        # The trees' structures hold the quantized tensors' metadata (logical shape, dtype, QuantizeSpec).
        result["quantized_structure"] = str(jax.tree.structure(quantized))
        result["restored_structure"] = str(jax.tree.structure(restored))
    return result


if __name__ == "__main__":
    process_id, coordinator, out = sys.argv[1:]
    join(2, int(process_id), coordinator)
    found = run_fsdp_steps(pathlib.Path(out) / "checkpoint")
    (pathlib.Path(out) / f"process{process_id}.pkl").write_bytes(pickle.dumps(found))
