"""run_unless: a skipped step changes nothing; under jit it is a select on every platform."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from support import machine, third_party

import jaxscale
from jaxscale.core._skip import run_unless, skip_by_select, skipped_updates_like

CARRY = {"p": jnp.array([1.0, -0.0, 3.0]), "count": jnp.array(7, jnp.int32)}


def update(carry):
    return {"p": carry["p"] * 2.0 - 1.0, "count": carry["count"] + 1}


def bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("strategy", [run_unless, skip_by_select])
def test_skip_keeps_the_carry_bitwise_and_a_step_applies_fn(strategy):
    step = jax.jit(lambda found, carry: strategy(found, update, carry))
    assert bits(step(jnp.asarray(True), CARRY)) == bits(CARRY)  # including the -0.0
    assert bits(step(jnp.asarray(False), CARRY)) == bits(update(CARRY))


def test_outputs_not_computed_from_the_carry_are_selected_back_too():
    # Besides values computed in the update, an update may return a constant, the
    # same computed value in two places, or an input untouched: each is selected.
    @jax.jit
    def nested(p):
        return p * 3.0, jnp.int32(5)

    def update(carry):
        doubled = carry["p"] * 2.0
        tripled, five = nested(carry["p"])
        return {"p": doubled, "q": doubled, "count": jnp.int32(0), "r": carry["p"],
                "t": tripled, "five": five}  # fmt: skip

    carry = {**CARRY, "q": jnp.array([4.0, 5.0, 6.0]), "r": jnp.array([7.0, 8.0, 9.0]),
             "t": jnp.array([1.5, 2.5, 3.5]), "five": jnp.int32(2)}  # fmt: skip
    step = jax.jit(lambda found, carry: skip_by_select(found, update, carry))
    assert bits(step(jnp.asarray(True), carry)) == bits(carry)
    assert bits(step(jnp.asarray(False), carry)) == bits(update(carry))


def test_a_function_called_twice_in_the_update_gives_each_call_its_own_result():
    # JAX traces a jitted function once and shares its program between the calls;
    # written into the skip's program, each call's values must stay apart.
    @jax.jit
    def halve(x):
        return x * 0.5

    def update(carry):
        first, second = halve(carry["p"]), halve(carry["p"] + 4.0)
        return {"p": first + second, "count": carry["count"] + 1}

    step = jax.jit(lambda found, carry: skip_by_select(found, update, carry))
    assert bits(step(jnp.asarray(False), CARRY)) == bits(update(CARRY))
    assert np.asarray(step(jnp.asarray(False), CARRY)["p"]).tolist() == [3.0, 2.0, 5.0]
    assert bits(step(jnp.asarray(True), CARRY)) == bits(CARRY)


def test_eager_calls_branch_in_python_and_never_trace():
    calls = []

    def counted(carry):
        calls.append(isinstance(carry["p"], jax.core.Tracer))
        return update(carry)

    assert run_unless(jnp.asarray(True), counted, CARRY) is CARRY
    assert calls == []
    run_unless(jnp.asarray(False), counted, CARRY)
    assert calls == [False]  # ran on concrete arrays: nothing compiled per call


def test_cpu_compiles_to_selects_without_loop_or_conditional():
    step = jax.jit(lambda f, c: run_unless(f, update, c))
    hlo = machine.compiled_on_cpu(step, jnp.asarray(True), CARRY).as_text()
    assert " while(" not in hlo
    assert " conditional(" not in hlo
    assert " select(" in hlo


@pytest.mark.parametrize("platform", ["cpu", "cuda", "rocm", "tpu"])
def test_every_platform_lowers_to_pure_dataflow(platform):
    # Lowered for each platform (no accelerator needed): no loop, only selects, so
    # no predicate ever travels to the host.
    traced = jax.jit(lambda f, c: run_unless(f, update, c)).trace(jnp.asarray(True), CARRY)
    text = traced.lower(lowering_platforms=(platform,)).as_text()
    assert "stablehlo.while" not in text
    assert "stablehlo.case" not in text
    assert "stablehlo.select" in text


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


def buffer_copies(hlo: str, shape: str) -> list[str]:
    """The instructions of an HLO module that copy a buffer of ``shape`` (the result's
    shape is printed right of ``=``: ``copy.3 = f32[4096]{0} copy(p.1)``)."""
    pattern = re.compile(rf"=\s*{re.escape(shape)}(\{{[^}}]*\}})?\s+copy\(")
    return [line.strip() for line in hlo.splitlines() if pattern.search(line)]


def test_buffer_copies_reads_hlo_as_xla_prints_it():
    hlo = "  copy.3 = f32[4096]{0} copy(p.1)\n  add.1 = f32[4096]{0} add(a, b)\n"
    assert buffer_copies(hlo, "f32[4096]") == ["copy.3 = f32[4096]{0} copy(p.1)"]
    # an update in place of a donated buffer that is read again afterwards: XLA copies it
    overwritten_then_read = jax.jit(lambda x: (x.at[0].set(5.0), jnp.flip(x)), donate_argnums=0)
    compiled = machine.compiled_on_cpu(overwritten_then_read, jnp.ones(4096))
    assert buffer_copies(compiled.as_text(), "f32[4096]") != []


def test_the_select_lets_xla_update_every_buffer_in_place():
    # The update of each parameter reads the moments the select wrote, so XLA
    # neither copies a donated buffer nor materialises the gradient p - d.
    step, params, opt_state = adam_step(skip_by_select)
    compiled = machine.compiled_on_cpu(step, params, opt_state, params)  # the CPU's copies
    assert buffer_copies(compiled.as_text(), "f32[4096]") == []
    gradients = 4 * 4096 * 4  # bytes of the four gradients
    assert compiled.memory_analysis().temp_size_in_bytes < gradients / 2


def test_the_select_reads_what_it_selected_and_skips_bitwise():
    step, params, opt_state = adam_step(skip_by_select)
    unskipped, _, _ = adam_step(lambda found_inf, fn, carry: fn(carry))
    data = jax.tree.map(lambda p: p * 0.5, params)
    poisoned = {**data, "p2": data["p2"].at[7].set(jnp.nan)}
    copy = functools.partial(jax.tree.map, jnp.copy)
    got = step(copy(params), copy(opt_state), data)
    want = unskipped(copy(params), copy(opt_state), data)
    assert bits(got) == bits(want)  # the update's own arithmetic, bit for bit
    skipped = step(copy(got[0]), copy(got[1]), poisoned)
    assert bits(skipped) == bits(got)


def applied_and_returned_step(skip):
    """A step shaped like ``nnx.Optimizer.update`` under the facade: the carry holds the
    parameters, Adam's state and the updates (``-0.0`` to start with), and the update
    both applies its updates to the parameters and returns them."""
    tx = third_party.optimizer(optax.adam(1e-3))

    def step(params, opt_state, data):
        grads = jax.tree.map(lambda p, d: p - d, params, data)
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))

        def update(carry):
            params, opt_state, _ = carry
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, updates

        carry = (params, opt_state, skipped_updates_like(params))
        return skip(jnp.logical_not(finite), update, carry)

    params = {f"p{i}": jnp.linspace(-1.0, 1.0, 4096) * (i + 1.0) for i in range(4)}
    return jax.jit(step), params, tx.init(params)


def test_a_returned_update_is_selected_once_not_again_where_the_parameters_read_it():
    # Each parameter's new value is selected against the old one, so the update it
    # adds needs no select of its own there: three selects per leaf (the two moments,
    # the parameter) in the fusions XLA compiles, and one more for the returned update.
    step, params, opt_state = applied_and_returned_step(skip_by_select)
    hlo = machine.compiled_on_cpu(step, params, opt_state, params).as_text()
    assert len(re.findall(r"= f32\[4096\]\{0\} select\(", hlo)) == 4 * 4
    unskipped, _, _ = applied_and_returned_step(lambda found_inf, fn, carry: fn(carry))
    data = jax.tree.map(lambda p: p * 0.5, params)
    applied = step(params, opt_state, data)
    assert bits(applied) == bits(unskipped(params, opt_state, data))  # bit for bit
    poisoned = {**data, "p1": data["p1"].at[9].set(jnp.inf)}
    skipped = step(applied[0], applied[1], poisoned)
    assert bits(skipped[:2]) == bits(applied[:2])  # bitwise, though the update was NaN
    assert bits(skipped[2]) == bits(skipped_updates_like(params))


@pytest.mark.parametrize("strategy", [run_unless, skip_by_select])
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


def compiled_size(n_leaves):
    """Lines of the optimized CPU program of a transform step over ``n_leaves`` leaves."""
    tx = jaxscale.grad_scaler(third_party.optimizer(optax.adam(1e-3)))
    params = {f"p{i:03d}": jnp.full((20_000,), i + 1.0) for i in range(n_leaves)}

    def loss(params, data):
        pairs = zip(params.values(), data.values(), strict=True)
        return sum(jnp.sum((p - d) ** 2) for p, d in pairs)

    def step(params, opt_state, data):
        grads = jax.grad(lambda p: jaxscale.scale(loss(p, data), opt_state))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    compiled = machine.compiled_on_cpu(jax.jit(step), params, tx.init(params), params)
    return len(compiled.as_text().splitlines())


def test_the_compiled_step_grows_linearly_with_the_number_of_leaves():
    # The skip decision is computed once and read by every selecting fusion. XLA
    # copies cheap scalar arithmetic into each fusion that reads it; were the
    # decision (an "and" over every leaf's check) copied into each leaf's update,
    # the program, and LLVM's time to compile it, would grow with the square of the
    # number of leaves: 81 s at 200 leaves on a 2-core CPU.
    small, large = compiled_size(20), compiled_size(40)
    assert large < 2.2 * small, (small, large)


def test_update_unless_traces_the_update_once_and_skips_to_negative_zero_updates():
    from jaxscale.core import update_unless

    traces = []

    def update(grads, state):
        traces.append(1)
        return {"w": -0.1 * grads["w"], "n": grads["n"]}, {"count": state["count"] + 1}

    grads = {"w": jnp.array([1.0, -2.0]), "n": jnp.array([3], jnp.int32)}
    state = {"count": jnp.int32(4)}
    step = jax.jit(lambda found_inf: update_unless(found_inf, update, grads, state))
    applied, skipped = step(jnp.asarray(False)), step(jnp.asarray(True))
    assert len(traces) == 1  # one trace gives the jaxpr and the updates' shapes
    np.testing.assert_allclose(applied[0]["w"], [-0.1, 0.2])
    assert int(applied[1]["count"]) == 5
    assert np.signbit(np.asarray(skipped[0]["w"])).all()
    assert skipped[0]["w"].tolist() == [0.0, 0.0]
    assert skipped[0]["n"].tolist() == [0]
    assert int(skipped[1]["count"]) == 4


def test_update_unless_refuses_an_update_that_changes_the_states_structure():
    from jaxscale.core import update_unless

    def update(grads, state):
        return grads, {"count": state["count"], "extra": state["count"]}

    with pytest.raises(ValueError, match="must return a state of its input's structure"):
        jax.jit(lambda f: update_unless(f, update, jnp.ones(2), {"count": jnp.int32(0)}))(
            jnp.asarray(False)
        )


def test_the_update_is_recorded_once_as_one_call_whatever_its_size():
    # The update is traced once; its program, with the selects placed, joins the
    # step as a single call, instead of being evaluated anew equation by equation.
    tx = third_party.optimizer(optax.adam(1e-3))
    params = {f"p{i}": jnp.full(8, float(i)) for i in range(5)}

    def step(found_inf, grads, state):
        return jaxscale.core.update_unless(found_inf, lambda g, s: tx.update(g, s), grads, state)

    jaxpr = jax.make_jaxpr(step)(jnp.asarray(False), params, tx.init(params)).jaxpr
    calls = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "jit"]
    assert [str(eqn.params["name"]) for eqn in calls] == ["skip_unless_finite"]
    assert not any(eqn.primitive.name == "sqrt" for eqn in jaxpr.eqns)
    inner = calls[0].params["jaxpr"].jaxpr
    assert sum(eqn.primitive.name == "sqrt" for eqn in inner.eqns) == 5  # inlined, once each
    selected = {eqn.outvars[0] for eqn in inner.eqns if eqn.primitive.name == "select_n"}
    assert len(inner.outvars) == 5 + 10 + 1  # updates, both moments, the count
    assert all(var in selected for var in inner.outvars)


def test_the_skip_is_differentiable_and_keeps_effects():
    # The call is an ordinary jit equation: gradients flow through it, and a
    # callback in the update still runs when the step runs.
    machine.cpu_device("jax.debug.callback hands its arguments to Python on a CPU device")
    printed = []

    def update(carry):
        jax.debug.callback(lambda p: printed.append(float(p[0])), carry["p"])
        return {"p": carry["p"] * 3.0, "count": carry["count"] + 1}

    def total(carry, found):
        return skip_by_select(found, update, carry)["p"].sum()

    for found, slope in [(False, 3.0), (True, 1.0)]:
        grads = jax.jit(jax.grad(total, allow_int=True))(CARRY, jnp.asarray(found))
        np.testing.assert_array_equal(np.asarray(grads["p"]), [slope] * 3)
    assert printed == [1.0, 1.0]
