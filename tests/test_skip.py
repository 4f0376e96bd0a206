"""run_unless: a skipped step changes nothing, by a loop on CPU/TPU and a select on GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
