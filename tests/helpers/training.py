"""A few Adam steps of an NNX model under ``nnx.jit``: the training loop the Flax tests share."""

from __future__ import annotations

from collections.abc import Callable


def nnx_adam_losses(model, loss: Callable, *batch, steps: int, learning_rate: float) -> list[float]:
    """``steps`` Adam updates of ``model``'s parameters (in place) on ``loss(model, *batch)``; each step's loss,
    before its update. Each step takes new stochastic-rounding keys from the model's NVFP4 streams."""
    import optax
    from flax import nnx

    optimizer = nnx.Optimizer(model, optax.adam(learning_rate), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, *batch):
        value, grads = nnx.value_and_grad(loss)(model, *batch)
        optimizer.update(model, grads)
        return value

    return [float(step(model, optimizer, *batch)) for _ in range(steps)]
