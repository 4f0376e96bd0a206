"""A gradient computed in the step is checked and used without being written out.

When the gradient is a cheap elementwise function of parameters and data, a
step without loss scaling never materialises it: XLA computes it inside the
optimizer's own pass. The check and the skip must keep it that way on the CPU:
the check reads it where it is computed (folded before the reduction), and the
skip is a select, which takes nothing whole. Each interface's optimized program
is inspected: no temporary anywhere near the gradients' size, no copy of a
parameter or moment.

Every buffer the step donates is also written in place: the state's scalars
included, which a GPU's CUDA graph reads from fixed addresses.
"""

import functools
import re

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from support import machine, third_party

import jaxscale

LEAVES, SIZE = 4, 1 << 16
GRADIENT_BYTES = LEAVES * SIZE * 4


def tree(offset):
    return {f"p{i}": jnp.linspace(-1.0, 1.0, SIZE) + offset + i for i in range(LEAVES)}


def loss(params, data):
    return sum(0.5 * jnp.sum((params[k] - data[k]) ** 2) for k in params)


def transform_step(**options):
    tx = jaxscale.grad_scaler(third_party.optimizer(optax.adam(1e-3)), **options)

    def step(params, opt_state, data):
        grads = jax.grad(lambda p: jaxscale.scale(loss(p, data), opt_state))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = tree(0.0)
    return jax.jit(step, donate_argnums=(0, 1)), (params, tx.init(params), tree(0.5))


def triple_step():
    tx = third_party.optimizer(optax.adam(1e-3))

    def step(params, opt_state, scaler, data):
        grads = jax.grad(lambda p: scaler.scale(loss(p, data)))(params)
        params, opt_state = scaler.step(tx, grads, opt_state, params)
        scaler.update()
        return params, opt_state, scaler

    params = tree(0.0)
    state = (params, tx.init(params), jaxscale.GradScaler(), tree(0.5))
    return jax.jit(step, donate_argnums=(0, 1, 2)), state


class Leaves(nnx.Module):
    def __init__(self):
        self.leaves = nnx.Dict({k: nnx.Param(v) for k, v in tree(0.0).items()})


def nnx_step():
    model = Leaves()
    optimizer = nnx.Optimizer(model, third_party.optimizer(optax.adam(1e-3)), wrt=nnx.Param)
    scaler = jaxscale.GradScaler()
    graphdef, state = nnx.split((model, optimizer, scaler))

    def step(state, data):
        model, optimizer, scaler = nnx.merge(graphdef, state)

        def scaled_loss(model):
            return scaler.scale(loss({k: v[...] for k, v in model.leaves.items()}, data))

        grads = nnx.grad(scaled_loss)(model)
        scaler.step(optimizer, model, grads)
        scaler.update()
        return nnx.state((model, optimizer, scaler))

    return jax.jit(step, donate_argnums=0), (state, tree(0.5))


STEPS = {"grad_scaler": transform_step, "optax triple": triple_step, "nnx.Optimizer": nnx_step}


@pytest.mark.parametrize("name", list(STEPS))
def test_the_gradients_are_never_written_out(name):
    step, args = STEPS[name]()
    compiled = machine.compiled_on_cpu(step, *args)  # what XLA's CPU backend fuses and copies
    # the folded check's flags (a byte per 8 elements) and scalars, nothing more
    assert compiled.memory_analysis().temp_size_in_bytes < GRADIENT_BYTES / 8
    copies = re.findall(r"= f32\[(\d+)\]\{0\} copy\(", compiled.as_text())
    assert copies == [], copies


def arrays(tree):
    """Copies of the parameter-sized leaves: the parameters and both moments."""
    return [jnp.copy(x) for x in jax.tree.leaves(tree) if x.shape == (SIZE,)]


@pytest.mark.parametrize("name", list(STEPS))
def test_the_same_step_applies_finite_gradients_and_skips_an_overflow(name):
    step, args = STEPS[name]()
    before = arrays(args[:-1])
    out = step(*args)
    out = out if isinstance(out, tuple) else (out,)
    stepped = arrays(out)
    assert all(x.tobytes() != y.tobytes() for x, y in zip(stepped, before, strict=True))
    poisoned = {**tree(0.5), "p1": tree(0.5)["p1"].at[3].set(jnp.inf)}
    skipped = arrays(step(*out, poisoned))
    assert [x.tobytes() for x in skipped] == [x.tobytes() for x in stepped]


def buffers(tree):
    return {
        jax.tree_util.keystr(path): x.unsafe_buffer_pointer()
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


IN_PLACE = {
    **STEPS,
    "grad_scaler, hysteresis 3": functools.partial(transform_step, hysteresis=3),
    "grad_scaler, static scale": functools.partial(transform_step, dynamic=False),
    "grad_scaler, overflow origin": functools.partial(transform_step, record_overflow_origin=True),
}


@pytest.mark.parametrize("name", list(IN_PLACE))
def test_every_donated_buffer_is_written_in_place(name):
    # jit drops an argument that nothing reads, and its donated buffer with it: a state
    # field the step only writes (found_inf, the streak under PyTorch's rule) would take
    # a fresh buffer at every call, and move the optimizer's step count out of place too
    step, args = IN_PLACE[name]()
    out = step(*args)
    out = out if isinstance(out, tuple) else (out,)
    before = buffers(out)
    again = step(*out, args[-1])
    after = buffers(again if isinstance(again, tuple) else (again,))
    moved = [path for path in before if after[path] != before[path]]
    assert moved == []
