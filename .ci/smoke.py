"""Smoke test of an installed jaxscale (a wheel in a clean environment, say): import it,
take one step with the Optax transform, one with the GradScaler facade, one under autocast."""

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxscale

params = {"w": jnp.ones(3)}
tx = jaxscale.grad_scaler(optax.sgd(0.1), init_scale=8.0)
opt_state = tx.init(params)
grads = {"w": jnp.full(3, 8.0)}  # the gradient of 8 * sum(w)
updates, opt_state = tx.update(grads, opt_state, params)
np.testing.assert_allclose(optax.apply_updates(params, updates)["w"], [0.9, 0.9, 0.9], rtol=1e-6)

model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
scaler = jaxscale.GradScaler(init_scale=8.0)


@nnx.jit
def step(model, optimizer, scaler, x):
    loss = lambda m: scaler.scale(jnp.sum(jaxscale.autocast(m)(x).astype(jnp.float32)))  # noqa: E731
    scaler.step(optimizer, model, nnx.grad(loss)(model))
    scaler.update()


before = model.kernel[...]
step(model, optimizer, scaler, jnp.ones((2, 3)))
assert not (model.kernel[...] == before).all()
assert scaler.get_scale() == 8.0
assert scaler.skipped_steps() == 0
print(f"jaxscale {jaxscale.__version__} from {jaxscale.__file__}: smoke test passed")
