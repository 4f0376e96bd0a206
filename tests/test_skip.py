"""run_unless: a skipped step changes nothing, by a loop on CPU/TPU and a select on GPU."""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import third_party

import jaxscale
from jaxscale.core._skip import run_unless, skip_by_loop, skip_by_select, skipped_updates_like

CARRY = {"p": jnp.array([1.0, -0.0, 3.0]), "count": jnp.array(7, jnp.int32)}


def update(carry):
    return {"p": carry["p"] * 2.0 - 1.0, "count": carry["count"] + 1}


def bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("strategy", [run_unless, skip_by_loop, skip_by_select])
def test_skip_keeps_the_carry_bitwise_and_a_step_applies_fn(strategy):
    step = jax.jit(lambda found, carry: strategy(found, update, carry))
    assert bits(step(jnp.asarray(True), CARRY)) == bits(CARRY)  # including the -0.0
    assert bits(step(jnp.asarray(False), CARRY)) == bits(update(CARRY))


def test_eager_calls_branch_in_python_and_never_trace():
    calls = []

    def counted(carry):
        calls.append(isinstance(carry["p"], jax.core.Tracer))
        return update(carry)

    assert run_unless(jnp.asarray(True), counted, CARRY) is CARRY
    assert calls == []
    run_unless(jnp.asarray(False), counted, CARRY)
    assert calls == [False]  # ran on concrete arrays: nothing compiled per call


def test_cpu_compiles_to_one_loop_and_no_conditional():
    step = jax.jit(lambda f, c: run_unless(f, update, c))
    hlo = step.lower(jnp.asarray(True), CARRY).compile().as_text()
    assert hlo.count(" while(") == 1
    assert " conditional(" not in hlo


def test_tpu_lowering_is_one_loop():
    traced = jax.jit(lambda f, c: run_unless(f, update, c)).trace(jnp.asarray(True), CARRY)
    assert traced.lower(lowering_platforms=("tpu",)).as_text().count("stablehlo.while") == 1


def adam_step(skip):
    tx = third_party.optimizer(optax.adam(1e-3))

    def step(params, opt_state, data):
        grads = jax.tree.map(lambda p, d: p - d, params, data)
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))

        def update(carry):
            params, opt_state = carry
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        return skip(jnp.logical_not(finite), update, (params, opt_state))

    params = {f"p{i}": jnp.linspace(-1.0, 1.0, 4096) * (i + 1.0) for i in range(4)}
    return jax.jit(step, donate_argnums=(0, 1)), params, tx.init(params)


def test_the_select_lets_xla_update_every_buffer_in_place():
    # The update of each parameter reads the moments the select wrote, so XLA
    # neither copies a donated buffer nor materialises the gradient p - d.
    step, params, opt_state = adam_step(skip_by_select)
    compiled = step.lower(params, opt_state, params).compile()
    assert " copy(" not in "".join(
        line for line in compiled.as_text().splitlines() if "f32[4096]" in line.split("=")[0]
    )
    gradients = 4 * 4096 * 4  # bytes of the four gradients
    assert compiled.memory_analysis().temp_size_in_bytes < gradients / 2
    looped, _, _ = adam_step(skip_by_loop)  # a loop takes the gradients whole
    assert (
        looped.lower(params, opt_state, params).compile().memory_analysis().temp_size_in_bytes
        >= gradients
    )


def test_the_select_reads_what_it_selected_and_skips_bitwise():
    step, params, opt_state = adam_step(skip_by_select)
    loop_step, _, _ = adam_step(skip_by_loop)
    data = jax.tree.map(lambda p: p * 0.5, params)
    poisoned = {**data, "p2": data["p2"].at[7].set(jnp.nan)}
    copy = functools.partial(jax.tree.map, jnp.copy)
    got = step(copy(params), copy(opt_state), data)
    want = loop_step(copy(params), copy(opt_state), data)
    assert bits(got) == bits(want)  # the same arithmetic as the loop, bit for bit
    skipped = step(copy(got[0]), copy(got[1]), poisoned)
    assert bits(skipped) == bits(got)


def test_gpu_lowering_is_pure_dataflow():
    # Lowered for CUDA (no GPU needed): no loop, only selects, so no predicate ever
    # travels to the host. (The one remaining case switches on a constant platform
    # index, which XLA folds away.)
    traced = jax.jit(lambda f, c: run_unless(f, update, c)).trace(jnp.asarray(True), CARRY)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "stablehlo.while" not in text
    assert "stablehlo.select" in text


@pytest.mark.parametrize("strategy", [run_unless, skip_by_loop, skip_by_select])
def test_vmap_decides_per_element(strategy):
    batch = jax.tree.map(lambda x: jnp.stack([x, x, x]), CARRY)
    found = jnp.array([True, False, True])
    out = jax.jit(jax.vmap(lambda f, c: strategy(f, update, c)))(found, batch)
    np.testing.assert_array_equal(np.asarray(out["count"]), [7, 8, 7])
    np.testing.assert_array_equal(np.asarray(out["p"][1]), [1.0, -1.0, 5.0])


def test_skipped_updates_are_negative_zero_of_each_dtype():
    shapes = jax.eval_shape(lambda: {"f": jnp.ones(2, jnp.bfloat16), "i": jnp.ones(2, jnp.int32)})
    updates = skipped_updates_like(shapes)
    assert updates["f"].dtype == jnp.bfloat16
    assert np.signbit(np.asarray(updates["f"], np.float32)).all()
    np.testing.assert_array_equal(np.asarray(updates["i"]), [0, 0])


def test_a_step_with_many_leaves_compiles_quickly_on_cpu():
    # XLA's CPU backend compiles a select whose predicate is reduced from gradients
    # computed in the same step in time quadratic in the number of leaves (81 s at
    # 200 leaves); the loop that the CPU's skip uses compiles in seconds.
    tx = jaxscale.grad_scaler(third_party.optimizer(optax.adam(1e-3)))
    params = {f"p{i:03d}": jnp.full((20_000,), i + 1.0) for i in range(200)}

    def loss(params, data):
        pairs = zip(params.values(), data.values(), strict=True)
        return sum(jnp.sum((p - d) ** 2) for p, d in pairs)

    def step(params, opt_state, data):
        grads = jax.grad(lambda p: jaxscale.scale(loss(p, data), opt_state))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    start = time.perf_counter()
    jax.jit(step).lower(params, tx.init(params), params).compile()
    assert time.perf_counter() - start < 40.0
