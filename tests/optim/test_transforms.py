"""The low-precision transforms: what each writes, their state, their errors, and how they
compose with each other, with ``grad_scaler``, with ``jit``, ``lax.scan`` and Orbax."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from support import third_party

import jaxscale

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


def adamw(learning_rate=1e-3, **kwargs):
    return third_party.optimizer(optax.adamw(learning_rate, **kwargs))


def apply(params, updates):
    # optax adds a float32 update to a half-precision parameter in float32, under
    # JAX's standard promotion (the suite runs with strict promotion)
    with third_party.standard_promotion():
        return optax.apply_updates(params, updates)


def make_params(dtype, key=0):
    keys = jax.random.split(jax.random.key(key), 2)
    return {
        "w": (jax.random.normal(keys[0], (64, 80)) * 0.1).astype(dtype),
        "b": jax.random.normal(keys[1], (80,)).astype(F32),
    }


def grads_for(params, index):
    def one(leaf, key):
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            return jnp.zeros_like(leaf)
        # values every floating dtype here holds exactly: a float32 run sees the same
        return (jax.random.normal(key, leaf.shape) * 0.1).astype(BF16).astype(leaf.dtype)

    keys = jax.random.split(jax.random.key(100 + index), 2)
    leaves, tree = jax.tree.flatten(params)
    return jax.tree.unflatten(tree, [one(leaf, k) for leaf, k in zip(leaves, keys, strict=False)])


def bits(leaf):
    """A leaf's bytes, for bitwise comparisons (a PRNG key by its key data)."""
    if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
    return np.asarray(leaf).reshape(-1).view(np.uint8)


def assert_within_an_ulp_of_the_largest(got, expected):
    """Floating leaves within one ulp (of their dtype) of their largest magnitude; the rest
    equal. Two different XLA programs computing the same float32 arithmetic (a step
    jitted alone and inside a scan) may round one operation differently."""
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        if not jnp.issubdtype(b.dtype, jnp.floating) or b.dtype.itemsize == 1:
            np.testing.assert_array_equal(bits(a), bits(b))
            continue
        wide_a, wide_b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        largest = np.abs(np.asarray(b)).max().astype(b.dtype)
        ulp = float(np.nextafter(largest, np.array(np.inf, b.dtype))) - float(largest)
        assert np.abs(wide_a - wide_b).max() <= ulp


def run(tx, params, steps, *, jit=True):
    """``steps`` updates applied to ``params``: [(params, state, updates)] after each."""
    state = tx.init(params)

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return apply(params, updates), state, updates

    step = jax.jit(step) if jit else step
    history = []
    for index in range(steps):
        params, state, updates = step(params, state, grads_for(params, index))
        history.append((params, state, updates))
    return history


# -- master_weights ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("jit", [True, False])
def test_master_weights_land_on_the_rounded_master_bitwise(dtype, jit):
    history = run(jaxscale.master_weights(adamw(1e-2)), make_params(dtype), 6, jit=jit)
    old = make_params(dtype)["w"].astype(F32)
    checked = 0
    for params, state, updates in history:
        rounded = state.masters["w"].astype(dtype)
        # the bound optax's one float32 addition can carry: zero, or >= 2**-12 of the old value
        exact = (rounded == 0) | (jnp.abs(rounded.astype(F32)) >= jnp.abs(old) * 2.0**-12)
        np.testing.assert_array_equal(np.asarray(params["w"])[exact], np.asarray(rounded)[exact])
        # already in float32, before optax's cast: the update is the exact difference, so
        # nothing is rounded twice
        landed = np.asarray(old + updates["w"])[exact]
        np.testing.assert_array_equal(landed, np.asarray(rounded.astype(F32))[exact])
        checked += int(exact.sum())
        old = params["w"].astype(F32)
        assert params["w"].dtype == dtype
        assert state.masters["w"].dtype == F32
        assert state.masters["b"] is None
    assert checked > 0.99 * 6 * 64 * 80


def test_master_weights_keep_no_copy_of_float32_or_integer_leaves():
    params = {**make_params(BF16), "count": jnp.arange(3)}
    masters = jaxscale.master_weights(third_party.optimizer(optax.sgd(0.1))).init(params).masters
    assert masters == {"w": masters["w"], "b": None, "count": None}


@pytest.mark.parametrize("jit", [True, False])
def test_master_weights_leave_float32_leaves_to_the_inner_optimizer(jit):
    params = make_params(BF16)
    ours = run(jaxscale.master_weights(adamw(1e-2)), params, 3, jit=jit)
    # inner alone, on the same float32 values the masters hold
    theirs = run(adamw(1e-2), {**params, "w": params["w"].astype(F32)}, 3, jit=jit)
    for (_, _, our_updates), (_, _, their_updates) in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(our_updates["b"], their_updates["b"])
    # and the masters follow inner's float32 trajectory: exactly when each operation runs
    # on its own; within an ulp when XLA compiles the two steps (their fusions differ)
    masters, expected = ours[-1][1].masters["w"], theirs[-1][0]["w"]
    if jit:
        assert_within_an_ulp_of_the_largest(masters, expected)
    else:
        np.testing.assert_array_equal(masters, expected)


def test_master_weights_learn_where_round_to_nearest_stalls():
    params = {"w": jnp.ones(512, BF16)}
    grads = {"w": jnp.full(512, 1.0, BF16)}

    def after(tx, steps=50):
        state, current = tx.init(params), params
        for _ in range(steps):
            updates, state = tx.update(grads, state, current)
            current = apply(current, updates)
        return float(current["w"][0])

    assert after(third_party.optimizer(optax.sgd(1e-3))) == 1.0  # 1e-3 < half an ulp at 1.0
    assert after(jaxscale.master_weights(third_party.optimizer(optax.sgd(1e-3)))) == 0.94921875


def test_master_params_finds_the_masters_anywhere_in_a_state():
    params = make_params(BF16)
    tx = jaxscale.grad_scaler(optax.chain(jaxscale.master_weights(adamw()), optax.identity()))
    state = tx.init(params)
    full = jaxscale.master_params(state, params)
    assert full["w"].dtype == F32
    np.testing.assert_array_equal(full["w"], params["w"].astype(F32))
    assert full["b"] is params["b"]
    with pytest.raises(ValueError, match="found none: pass the state of an optimizer built"):
        jaxscale.master_params(adamw().init(params), params)
    two = (state, state)
    with pytest.raises(ValueError, match=r"found 2: .* the sub-state that holds the one"):
        jaxscale.master_params(two, params)


# -- stochastic_rounding -----------------------------------------------------------------------


def test_stochastic_rounding_writes_sr_of_the_float32_sum_with_the_states_key():
    # inner runs in float32 on the widened parameters, gradients and state, and its
    # state is kept in the dtypes it has for the parameters: bfloat16 moments for "w"
    params = make_params(BF16)
    key = jax.random.key(7)
    tx = jaxscale.stochastic_rounding(adamw(1e-3), key=key)
    inner = adamw(1e-3)
    inner_state = inner.init(params)
    assert inner_state[0].mu["w"].dtype == BF16
    state = tx.init(params)
    assert jax.tree.map(lambda x: x.dtype, state.inner_state) == jax.tree.map(
        lambda x: x.dtype, inner_state
    )

    def widened(tree):
        return jax.tree.map(lambda x: x.astype(F32) if x.dtype == BF16 else x, tree)

    @jax.jit
    def reference(grads, inner_state, params):
        updates, new_state = inner.update(widened(grads), widened(inner_state), widened(params))
        narrowed = jax.tree.map(lambda new, old: new.astype(old.dtype), new_state, inner_state)
        return updates, narrowed

    step = jax.jit(tx.update)
    for index in range(3):
        grads = grads_for(params, index)
        updates, state = step(grads, state, params)
        expected_updates, inner_state = reference(grads, inner_state, params)
        key, step_key = jax.random.split(key)
        w_key = jax.random.fold_in(step_key, 1)  # "w" is the second leaf in key order
        wide_w = params["w"].astype(F32)
        expected_w = jaxscale.stochastic_round(wide_w + expected_updates["w"], key=w_key)
        params = apply(params, updates)
        np.testing.assert_array_equal(params["w"], expected_w)
        np.testing.assert_allclose(updates["b"], expected_updates["b"], rtol=1e-6)
        np.testing.assert_array_equal(jax.random.key_data(state.key), jax.random.key_data(key))
        for ours, theirs in zip(
            jax.tree.leaves(state.inner_state), jax.tree.leaves(inner_state), strict=True
        ):
            assert ours.dtype == theirs.dtype
            np.testing.assert_allclose(
                np.asarray(ours, F32), np.asarray(theirs, F32), rtol=2**-8, atol=1e-12
            )


def test_stochastic_rounding_keeps_float32_state_when_asked():
    params = make_params(BF16)
    for asked in (F32, "float32"):
        tx = jaxscale.stochastic_rounding(adamw(), key=jax.random.key(0), state_dtype=asked)
        state = tx.init(params)
        assert state.inner_state[0].mu["w"].dtype == F32
        _, new_state = jax.jit(tx.update)(grads_for(params, 0), state, params)
        assert new_state.inner_state[0].nu["w"].dtype == F32
    with pytest.raises(ValueError, match="state_dtype must be a floating dtype or its name"):
        jaxscale.stochastic_rounding(adamw(), key=jax.random.key(0), state_dtype="int8")


def test_stochastic_rounding_moves_half_precision_parameters_by_the_update_on_average():
    params = {"w": jnp.ones(20_000, F16)}
    tx = jaxscale.stochastic_rounding(third_party.optimizer(optax.sgd(1e-4)), key=jax.random.key(1))
    state = tx.init(params)
    for _ in range(20):
        updates, state = tx.update({"w": jnp.ones(20_000, F16)}, state, params)
        params = apply(params, updates)
    assert float(jnp.mean(params["w"].astype(F32))) == pytest.approx(1 - 20e-4, abs=2e-5)


def test_stochastic_rounding_refuses_what_is_not_a_key():
    with pytest.raises(
        TypeError, match=r"key must be a JAX PRNG key, e.g. key=jax.random.key\(0\)"
    ):
        jaxscale.stochastic_rounding(adamw(), key=0)


# -- kahan_summation ---------------------------------------------------------------------------


def ulps(got, expected, dtype):
    """|got - expected| in units of the spacing of ``dtype`` at ``expected`` (float64)."""
    expected = np.asarray(expected, np.float64)
    near = np.abs(expected.astype(np.float32).astype(dtype))
    spacing = np.nextafter(near, np.array(np.inf, dtype)).astype(np.float64) - near
    return np.abs(np.asarray(got, np.float64) - expected) / spacing


@pytest.mark.parametrize(("dtype", "smallest"), [(BF16, 0.0), (F16, 2.0**-10)])
def test_kahan_summation_follows_the_float32_sum_of_the_updates_within_an_ulp(dtype, smallest):
    # Plain Adam's updates do not depend on the parameters: the float32 run is the sum.
    # Below 2**-10 a float16 buffer's own subnormals limit it (1.75 ulps measured).
    steps = 200
    params = {"w": (jax.random.normal(jax.random.key(0), (4096,)) * 4).astype(dtype)}
    inner = third_party.optimizer(optax.adam(1e-4))
    # float32 moments, as the float32 run keeps: the updates are then the same
    ours = run(jaxscale.kahan_summation(inner, state_dtype=F32), params, steps)
    expected = run(inner, {"w": params["w"].astype(F32)}, steps)[-1][0]["w"]
    checked = np.abs(np.asarray(expected)) >= smallest
    assert checked.mean() > 0.99
    assert ulps(ours[-1][0]["w"], expected, dtype)[checked].max() <= 0.51
    # the same updates added with round to nearest alone drift many ulps away
    plain = params["w"]
    for _, _, updates in run(inner, {"w": params["w"].astype(F32)}, steps):
        plain = (plain.astype(F32) + updates["w"]).astype(dtype)
    assert ulps(plain, expected, dtype)[checked].max() > 20
    assert ours[-1][1].compensation["w"].dtype == dtype


def test_kahan_summation_keeps_the_inner_state_in_the_parameters_dtypes():
    params = make_params(BF16)
    tx = jaxscale.kahan_summation(adamw())
    state = tx.init(params)
    assert state.inner_state[0].mu["w"].dtype == BF16  # as optax.adamw keeps it
    assert state.inner_state[0].mu["b"].dtype == F32
    _, new_state = jax.jit(tx.update)(grads_for(params, 0), state, params)
    assert jax.tree.map(lambda x: x.dtype, new_state) == jax.tree.map(lambda x: x.dtype, state)
    assert state_bytes_per_parameter(state.inner_state, {"w": params["w"]}) < 4.6


def test_kahan_summation_leaves_float32_parameters_to_the_inner_optimizer():
    params = make_params(BF16)
    ours = run(jaxscale.kahan_summation(adamw()), params, 2)
    theirs = run(adamw(), {**params, "w": params["w"].astype(F32)}, 2)
    np.testing.assert_array_equal(ours[-1][2]["b"], theirs[-1][2]["b"])
    assert ours[-1][1].compensation["b"] is None


# -- low_precision_state -----------------------------------------------------------------------


def state_bytes_per_parameter(state, params) -> float:
    count = sum(leaf.size for leaf in jax.tree.leaves(params))
    return sum(leaf.nbytes for leaf in jax.tree.leaves(state)) / count


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [(None, 8.0), (BF16, 4.0), (jnp.float8_e4m3fn, 2 + 8 / 256), ("int8", 2 + 8 / 256)],
)
def test_bytes_of_adams_state_per_parameter(dtype, expected):
    params = {"w": jnp.zeros((1024, 1024))}
    inner = optax.adam(1e-3)
    tx = inner if dtype is None else jaxscale.low_precision_state(inner, dtype)
    assert state_bytes_per_parameter(tx.init(params), params) == pytest.approx(expected, abs=1e-4)


def test_the_8_bit_formats_quantize_as_torchao_chooses():
    params = {
        "big": jnp.zeros((64, 64)),  # 4,096 elements: quantized
        "small": jnp.zeros((4095,)),  # fewer: kept
        "odd": jnp.zeros((4096 + 100,)),  # not a multiple of the block: kept
    }
    state = jaxscale.low_precision_state(optax.adam(1e-3), "int8").init(params).inner_state[0]
    assert isinstance(state.mu["big"], jaxscale.BlockQuantized)
    assert isinstance(state.nu["big"], jaxscale.BlockQuantized)
    assert state.mu["small"].dtype == F32
    assert state.mu["odd"].dtype == F32
    assert state.count.dtype == jnp.int32


def test_bfloat16_state_keeps_scalars():
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
    state = jaxscale.low_precision_state(tx, BF16).init({"w": jnp.zeros(10)}).inner_state
    assert state.hyperparams["learning_rate"].dtype == F32
    assert state.inner_state[0].mu["w"].dtype == BF16


@pytest.mark.parametrize("dtype", [BF16, jnp.float8_e4m3fn, "int8"])
def test_the_inner_optimizer_runs_on_the_widened_state(dtype):
    # one update: widen, run inner in float32, narrow. Checked against doing it by hand.
    params = {"w": jax.random.normal(jax.random.key(0), (64, 128))}
    inner = third_party.optimizer(optax.adam(1e-3))
    tx = jaxscale.low_precision_state(inner, dtype)
    state = tx.init(params)
    for index in range(3):
        grads = grads_for(params, index)
        updates, new_state = jax.jit(tx.update)(grads, state, params)
        stored = state.inner_state[0]
        if dtype == BF16:
            mu, nu = stored.mu["w"].astype(F32), stored.nu["w"].astype(F32)
        else:
            mu = jaxscale.dequantize_blockwise(*stored.mu["w"], dtype, signed=True)
            nu = jaxscale.dequantize_blockwise(*stored.nu["w"], dtype, signed=False)
        wide = (stored._replace(mu={"w": mu}, nu={"w": nu}), *state.inner_state[1:])
        expected_updates, expected_state = jax.jit(inner.update)(grads, wide, params)
        np.testing.assert_array_equal(updates["w"], expected_updates["w"])
        new_mu = new_state.inner_state[0].mu["w"]
        if dtype == BF16:
            np.testing.assert_array_equal(new_mu, expected_state[0].mu["w"].astype(BF16))
        else:
            codes, _ = jaxscale.quantize_blockwise(expected_state[0].mu["w"], dtype)
            np.testing.assert_array_equal(
                np.asarray(new_mu.codes).view(np.uint8), np.asarray(codes).view(np.uint8)
            )
            codes, _ = jaxscale.quantize_blockwise(expected_state[0].nu["w"], dtype, signed=False)
            np.testing.assert_array_equal(
                np.asarray(new_state.inner_state[0].nu["w"].codes).view(np.uint8),
                np.asarray(codes).view(np.uint8),
            )
        state, params = new_state, apply(params, updates)


def test_a_state_that_changes_shape_is_named():
    def init(params):
        return {"acc": jnp.zeros(3)}

    def update(updates, state, params=None):
        return updates, {"acc": jnp.zeros(4)}

    tx = jaxscale.low_precision_state(optax.GradientTransformation(init, update))
    with pytest.raises(
        ValueError, match=r"state leaf .*'acc'.* was bfloat16\[3\] after init and is bfloat16\[4\]"
    ):
        tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.ones(2)}))


def test_grad_scaler_names_an_inner_state_that_changes_dtype():
    # optax.adam on bfloat16 parameters given float32 gradients returns float32 moments
    params = {"w": jnp.ones(4, BF16)}
    tx = jaxscale.grad_scaler(adamw())
    state = tx.init(params)
    with pytest.raises(
        ValueError,
        match=r"leaf \[0\]\.mu\['w'\] is bfloat16\[4\] before the update and float32\[4\]",
    ):
        jax.jit(tx.update)({"w": jnp.ones(4, F32)}, state, params)


@pytest.mark.parametrize(
    "make",
    [
        jaxscale.master_weights,
        jaxscale.kahan_summation,
        jaxscale.low_precision_state,
        functools.partial(jaxscale.stochastic_rounding, key=jax.random.key(0)),
    ],
)
def test_a_factory_passed_uncalled_is_named(make):
    with pytest.raises(TypeError, match=r"got the function adamw: call it first, e\.g\."):
        make(optax.adamw)


@pytest.mark.parametrize(
    "make",
    [
        jaxscale.master_weights,
        jaxscale.kahan_summation,
        functools.partial(jaxscale.stochastic_rounding, key=jax.random.key(0)),
    ],
)
def test_updates_without_params_are_refused_by_name(make):
    tx = make(adamw())
    params = make_params(BF16)
    with pytest.raises(ValueError, match=r"needs them: call tx.update\(grads, opt_state, params\)"):
        tx.update(grads_for(params, 0), tx.init(params))


def test_low_precision_state_refuses_other_formats():
    with pytest.raises(
        ValueError,
        match=r"dtype must be 'bfloat16', 'float8_e4m3fn', 'int8' or 'int4' \(the strings, "
        r"or jnp.bfloat16, .*\), got <class 'jax.numpy.float16'>",
    ):
        jaxscale.low_precision_state(adamw(), jnp.float16)
    with pytest.raises(ValueError, match="block_size must be an int of at least 2, got 0"):
        jaxscale.low_precision_state(adamw(), "int8", block_size=0)
    with pytest.raises(ValueError, match="bfloat16 state is stored element by element"):
        jaxscale.low_precision_state(adamw(), "bfloat16", block_size=128)
    # a truthy string would have quantized every leaf's partial blocks without a word
    with pytest.raises(TypeError, match="partial_blocks must be True or False, got 'yes'"):
        jaxscale.low_precision_state(adamw(), "int8", partial_blocks="yes")


# -- composition -------------------------------------------------------------------------------


def everything(dtype="int8"):
    """Every transform at once: 8-bit Adam state around float32 masters, inside Kahan and
    stochastic rounding would be redundant, so two chains."""
    return {
        "masters + int8 state": jaxscale.low_precision_state(
            jaxscale.master_weights(adamw()), dtype
        ),
        "int8 state inside masters": jaxscale.master_weights(
            jaxscale.low_precision_state(adamw(), dtype)
        ),
        "kahan + bf16 state": jaxscale.kahan_summation(jaxscale.low_precision_state(adamw())),
        "stochastic rounding + fp8 state": jaxscale.stochastic_rounding(
            jaxscale.low_precision_state(adamw(), jnp.float8_e4m3fn), key=jax.random.key(3)
        ),
    }


def test_low_precision_state_keeps_masters_at_full_precision():
    params = make_params(BF16)
    state = everything()["masters + int8 state"].init(params)
    masters = state.inner_state.masters
    assert masters["w"].dtype == F32
    np.testing.assert_array_equal(masters["w"], params["w"].astype(F32))
    assert isinstance(state.inner_state.inner_state[0].mu["w"], jaxscale.BlockQuantized)


@pytest.mark.parametrize("name", list(everything()))
def test_a_skipped_step_changes_nothing_bitwise(name):
    params = make_params(BF16)
    tx = jaxscale.grad_scaler(everything()[name], init_scale=4.0)

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(jaxscale.scale(grads, state), state, params)
        return apply(params, updates), state

    state = tx.init(params)
    for index in range(2):  # a state that has moved away from its init
        params, state = step(params, state, grads_for(params, index))
    bad = grads_for(params, 2)
    bad["b"] = bad["b"].at[3].set(jnp.inf)
    new_params, new_state = step(params, state, bad)
    assert bool(jaxscale.found_inf(new_state))
    before = jax.tree.leaves((params, state.inner_state))
    after = jax.tree.leaves((new_params, new_state.inner_state))
    for old, new in zip(before, after, strict=True):
        np.testing.assert_array_equal(bits(old), bits(new))


@pytest.mark.parametrize("name", list(everything()))
def test_steps_under_lax_scan_equal_steps_in_a_loop(name):
    tx = everything()[name]
    params = make_params(BF16)
    grads = [grads_for(params, index) for index in range(3)]
    looped = run(tx, params, 3)[-1][:2]

    def body(carry, grads):
        params, state = carry
        updates, state = tx.update(grads, state, params)
        return (apply(params, updates), state), None

    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *grads)
    (scanned_params, scanned_state), _ = jax.jit(lambda c, g: jax.lax.scan(body, c, g))(
        (params, tx.init(params)), stacked
    )
    looped_params, looped_state = looped
    assert_within_an_ulp_of_the_largest(scanned_params, looped_params)
    # The state is the same state; where one float32 operation rounds differently in the
    # two programs (XLA fuses them differently), a stored bfloat16 moment can round the
    # other way, and the next steps carry that on (measured: up to 4 bfloat16 ulps); a
    # parameter rounded the other way moves its Kahan buffer by the parameter's ulp.
    largest = np.abs(np.asarray(looped_params["w"], F32)).max()
    parameter_ulp = float(np.spacing(largest.astype(BF16)))
    assert jax.tree.structure(scanned_state) == jax.tree.structure(looped_state)
    for a, b in zip(jax.tree.leaves(scanned_state), jax.tree.leaves(looped_state), strict=True):
        assert a.dtype == b.dtype
        if jnp.issubdtype(a.dtype, jnp.floating) and a.dtype.itemsize > 1:
            np.testing.assert_allclose(
                np.asarray(a, F32), np.asarray(b, F32), rtol=2**-5, atol=parameter_ulp
            )


@pytest.mark.parametrize("name", list(everything()))
def test_the_cuda_step_has_no_loop_conditional_or_callback(name):
    tx = jaxscale.grad_scaler(everything()[name])
    params = make_params(BF16)

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return apply(params, updates), state

    report = jaxscale.lowering_report(step, params, tx.init(params), grads_for(params, 0))
    assert not report.syncs_with_host, report
    assert report.loops == report.counted_loops


def test_states_round_trip_through_an_orbax_checkpoint(tmp_path):
    import orbax.checkpoint as ocp

    params = make_params(BF16)
    tx = jaxscale.grad_scaler(everything()["stochastic rounding + fp8 state"])
    _, state = jax.jit(tx.update)(grads_for(params, 0), tx.init(params), params)
    checkpointer = ocp.StandardCheckpointer()
    saved = jax.tree.map(
        lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x,
        state,
    )
    checkpointer.save(tmp_path / "state", saved)
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(tmp_path / "state", saved)
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(restored), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(bits(a), bits(b))


# -- one rule for dtypes, and no silent no-ops --------------------------------------------------


@pytest.mark.parametrize(
    ("given", "stored"),
    [
        ("bfloat16", BF16),
        (BF16, BF16),
        ("float8_e4m3fn", jnp.float8_e4m3fn),
        (jnp.float8_e4m3fn, jnp.float8_e4m3fn),
        ("int8", jnp.uint8),
        (jnp.int8, jnp.uint8),
        ("int4", jnp.uint8),
        (jnp.int4, jnp.uint8),
    ],
)
def test_a_state_dtype_is_taken_as_a_dtype_or_its_name(given, stored):
    params = {"w": jnp.zeros((64, 64))}
    mu = jaxscale.low_precision_state(adamw(), given).init(params).inner_state[0].mu["w"]
    assert (mu.codes if isinstance(mu, jaxscale.BlockQuantized) else mu).dtype == stored


def test_every_dtype_argument_takes_names_and_positions_alike():
    params = {"w": jnp.ones(4, BF16)}
    by_name = jaxscale.master_weights(adamw(), "float32").init(params)
    assert by_name.masters["w"].dtype == F32
    x = jnp.full(4, 1.0 + 2.0**-12, F32)
    np.testing.assert_array_equal(
        jaxscale.stochastic_round(x, "float16", bits=np.zeros(4, np.int32)),
        jaxscale.stochastic_round(x, jnp.float16, bits=np.zeros(4, np.int32)),
    )


def test_masters_as_wide_as_the_parameters_are_refused():
    with pytest.raises(ValueError, match=r"parameter \['w'\] is bfloat16, as wide as the masters"):
        jaxscale.master_weights(adamw(), jnp.float16).init({"w": jnp.ones(4, BF16)})


def test_masters_of_parameters_init_saw_wider_are_refused():
    tx = jaxscale.master_weights(adamw())
    state = tx.init({"w": jnp.ones(4)})
    params = {"w": jnp.ones(4, BF16)}
    with pytest.raises(ValueError, match=r"init saw it wider and kept no master of it"):
        tx.update(params, state, params)


@pytest.mark.parametrize(
    ("outer", "inner"),
    [
        ("stochastic_rounding", "master_weights"),
        ("kahan_summation", "stochastic_rounding"),
        ("master_weights", "kahan_summation"),
        ("stochastic_rounding", "kahan_summation"),
    ],
)
def test_a_parameter_writer_inside_another_is_refused(outer, inner):
    make = {
        "master_weights": jaxscale.master_weights,
        "kahan_summation": jaxscale.kahan_summation,
        "stochastic_rounding": functools.partial(
            jaxscale.stochastic_rounding, key=jax.random.key(0)
        ),
    }
    tx = make[outer](make[inner](adamw()))
    with pytest.raises(ValueError, match=rf"{outer}\({inner}\(\.\.\.\)\): {inner} inside {outer}"):
        tx.init(make_params(BF16))


def test_a_block_size_that_divides_no_leaf_is_named():
    params = {"w": jnp.zeros((64, 64))}
    with pytest.warns(UserWarning, match=r"block_size=1000\) quantizes none of the 2 state leaves"):
        jaxscale.low_precision_state(adamw(), "int8", block_size=1000).init(params)


# -- where the writers go among other transforms ------------------------------------------------


def scan_with_a_bad_step(tx, params, bad=1, steps=3):
    """``steps`` updates, the ``bad``-th with an infinite gradient: the parameters and
    state after each."""
    state = tx.init(params)
    history = []
    for index in range(steps):
        grads = grads_for(params, index)
        if index == bad:
            grads = jax.tree.map(lambda g: g.at[0].set(jnp.inf), grads)
        updates, state = jax.jit(tx.update)(grads, state, params)
        params = apply(params, updates)
        history.append((params, state))
    return history


def test_apply_if_finite_goes_inside_the_writer():
    # optax.apply_if_finite(master_weights(...)) cannot compile: its skip returns zeros of
    # the gradients' dtype (bfloat16) and the writer float32 updates, which a bfloat16
    # parameter needs to land exactly. Inside, it skips the optimizer and the masters
    # keep still: a zero update lands the parameters on themselves.
    tx = jaxscale.master_weights(third_party.optimizer(optax.apply_if_finite(optax.adamw(1e-2), 3)))
    params = make_params(BF16)
    history = scan_with_a_bad_step(tx, params)
    (first, first_state), (second, second_state) = history[0], history[1]
    np.testing.assert_array_equal(second["w"], first["w"])
    np.testing.assert_array_equal(second_state.masters["w"], first_state.masters["w"])
    assert not np.array_equal(history[2][0]["w"], second["w"])


@pytest.mark.parametrize("order", ["scaler outside", "scaler inside"])
def test_grad_scaler_and_master_weights_nest_either_way(order):
    if order == "scaler outside":
        tx = jaxscale.grad_scaler(jaxscale.master_weights(adamw(1e-2)), init_scale=1.0)
    else:
        tx = jaxscale.master_weights(jaxscale.grad_scaler(adamw(1e-2), init_scale=1.0))
    params = make_params(BF16)
    history = scan_with_a_bad_step(tx, params)
    np.testing.assert_array_equal(history[1][0]["w"], history[0][0]["w"])
    expected = scan_with_a_bad_step(jaxscale.master_weights(adamw(1e-2)), params, bad=-1, steps=2)
    # the applied steps are the same steps: the first, and then the third as the second
    np.testing.assert_array_equal(history[0][0]["w"], expected[0][0]["w"])


def test_a_writer_in_a_chain_comes_last():
    # the writer's updates land the parameters exactly; a transform after it would move
    # them off that value, so clipping and the like go before it, or inside it
    clip = third_party.optimizer(optax.clip_by_global_norm(0.1))
    before = optax.chain(clip, jaxscale.master_weights(adamw(1e-2)))
    inside = jaxscale.master_weights(optax.chain(clip, adamw(1e-2)))
    params = make_params(BF16)
    for tx in (before, inside):
        for params_after, state, _ in run(tx, params, 3):
            masters = jaxscale.master_params(state, params_after)
            np.testing.assert_array_equal(masters["w"].astype(BF16), params_after["w"])


def test_amsgrads_running_maximum_is_a_second_moment_stored_with_the_unsigned_map():
    # torchao keeps max_exp_avg_sq with the unsigned map, as every second moment
    inner = third_party.optimizer(optax.amsgrad(1e-3))
    tx = jaxscale.low_precision_state(inner, "int8")
    params = {"w": jax.random.normal(jax.random.key(0), (64, 128))}
    state, wide = tx.init(params), inner.init(params)
    for index in range(3):
        grads = grads_for(params, index)
        _, state = jax.jit(tx.update)(grads, state, params)
        _, wide = jax.jit(inner.update)(grads, wide, params)
    stored = state.inner_state[0].nu_max["w"]
    exact = np.asarray(wide[0].nu_max["w"])
    codes, _ = jaxscale.quantize_blockwise(wide[0].nu_max["w"], "int8", signed=False)
    read = np.asarray(jaxscale.dequantize_blockwise(*stored, "int8", signed=False))
    # stored through the same quantization each step: the unsigned map's error, a few %
    assert np.median(np.abs(read - exact) / exact) < 0.06
    assert np.mean(np.asarray(stored.codes) == np.asarray(codes)) > 0.9


def test_block_size_sets_the_blocks_of_the_stored_state():
    params = {"w": jnp.zeros((64, 128))}
    for block_size, blocks in ((256, 32), (128, 64), (1024, 8)):
        tx = jaxscale.low_precision_state(optax.adam(1e-3), "int8", block_size=block_size)
        assert tx.init(params).inner_state[0].mu["w"].scale.size == blocks


@pytest.mark.parametrize("dtype", ["int8", jnp.float8_e4m3fn])
def test_kahan_compensation_under_low_precision_state_is_kept_in_the_parameters_dtype(dtype):
    # the compensation is part of the parameter, not a statistic: it is not quantized
    params = {"w": jnp.zeros((64, 128), BF16)}
    tx = jaxscale.low_precision_state(jaxscale.kahan_summation(optax.adam(1e-3)), dtype)
    state = tx.init(params).inner_state
    assert isinstance(state, jaxscale.KahanSummationState)
    assert state.compensation["w"].dtype == BF16
    assert isinstance(state.inner_state[0].mu["w"], jaxscale.BlockQuantized)


RNG_STEPS = np.random.default_rng(7).normal(size=(5, 64, 128))


@pytest.mark.parametrize("dtype", ["int8", "bfloat16"])
def test_accumulated_gradients_and_schedule_free_iterates_are_not_narrowed(dtype):
    # optax.MultiSteps and apply_every accumulate gradients, schedule-free keeps a sequence
    # of parameters: only the optimizer state inside them is narrowed
    params = {"w": jnp.asarray(RNG_STEPS[-1] / 10, F32)}
    wrapped = {
        "MultiSteps": third_party.optimizer(optax.MultiSteps(adamw(), 2)),
        "schedule_free": third_party.optimizer(optax.contrib.schedule_free_adamw(1e-3)),
        "apply_every": third_party.optimizer(optax.chain(optax.apply_every(2), adamw())),
    }
    narrow = BF16 if dtype == "bfloat16" else jaxscale.BlockQuantized
    for name, inner in wrapped.items():
        state = jaxscale.low_precision_state(inner, dtype).init(params).inner_state
        kept, statistics = {
            "MultiSteps": lambda s: (s.acc_grads, s.inner_opt_state[0].mu),
            "schedule_free": lambda s: (s.z, s.base_optimizer_state[0].nu),
            "apply_every": lambda s: (s[0].grad_acc, s[1][0].mu),
        }[name](state)
        assert kept["w"].dtype == F32, name
        stat = statistics["w"]
        assert (stat.dtype == BF16) if narrow is BF16 else isinstance(stat, narrow), name

    # outside or inside MultiSteps, the same steps: accumulated in float32 either way (to
    # float32's last bit: XLA fuses the update into other operations in the two programs,
    # which with JAX 0.10.0 rounds 22 of 8192 parameters differently)
    def run(tx):
        state, p = tx.init(params), params
        for index in range(4):
            grads = {"w": jnp.asarray(RNG_STEPS[index], F32)}
            updates, state = jax.jit(tx.update)(grads, state, p)
            p = optax.apply_updates(p, updates)
        return p

    inside = optax.MultiSteps(jaxscale.low_precision_state(adamw(), dtype), 2)
    outside = jaxscale.low_precision_state(
        third_party.optimizer(optax.MultiSteps(adamw(), 2)), dtype
    )
    np.testing.assert_allclose(
        run(third_party.optimizer(inside))["w"], run(outside)["w"], rtol=2e-7, atol=1e-7
    )


STARTING_POINTS = {
    # optimizers that keep the parameters they started from, and where
    "prodigy": (lambda: optax.contrib.prodigy(1.0), lambda s: s.params0),
    "dog": (lambda: optax.contrib.dog(1.0), lambda s: s[1].init_params),
    "dowg": (lambda: optax.contrib.dowg(1.0), lambda s: s[1].init_params),
    "cocob": (lambda: optax.contrib.cocob(), lambda s: s[2].init_particles),
    "madgrad": (lambda: optax.contrib.madgrad(1e-2), lambda s: s[1].x0),
    "mechanize": (lambda: optax.contrib.mechanize(adamw()), lambda s: s.x0),
}


@pytest.mark.parametrize("name", list(STARTING_POINTS))
@pytest.mark.parametrize("dtype", ["int8", "bfloat16"])
def test_the_parameters_an_optimizer_started_from_are_kept_as_they_are(name, dtype):
    # Prodigy, DoG, MADGRAD and the like measure the distance travelled from the starting
    # parameters: rounded to 8 bits, a starting point moves (Prodigy then stepped 1,000
    # times further than optax's in its first steps)
    make, starting_point = STARTING_POINTS[name]
    if name == "madgrad" and not hasattr(optax.contrib, "madgrad"):
        pytest.skip("optax.contrib.madgrad arrived in optax 0.2.5")
    params = {"w": jnp.asarray(RNG_STEPS[-1] / 10, F32)}
    tx = jaxscale.low_precision_state(third_party.optimizer(make()), dtype)
    for init in (tx.init, jax.jit(tx.init)):
        state = init(params).inner_state
        kept = starting_point(state)["w"]
        assert kept.dtype == F32
        if name not in ("dog", "dowg"):  # (optax before 0.2.5 fills those at the first step)
            np.testing.assert_array_equal(kept, params["w"])
        quantized = lambda n: isinstance(n, jaxscale.BlockQuantized)  # noqa: E731
        narrowed = [
            leaf
            for leaf in jax.tree.leaves(state, is_leaf=quantized)
            if quantized(leaf) or getattr(leaf, "dtype", None) == BF16
        ]
        assert narrowed or name in ("dog", "dowg"), "the statistics are still narrowed"
    updated = jax.jit(tx.update)({"w": jnp.asarray(RNG_STEPS[0], F32)}, tx.init(params), params)
    np.testing.assert_array_equal(starting_point(updated[1].inner_state)["w"], params["w"])


def regression_loss(params, index):
    """A small regression's loss on batch ``index``: gradients of a real loss's sizes."""
    x = jnp.asarray(RNG_STEPS[index][:32], F32)
    return jnp.mean((jnp.tanh(x @ params["w"].T) - 0.5) ** 2)


def test_prodigys_step_size_estimate_follows_optaxs_with_bfloat16_state():
    # with the starting point rounded, Prodigy read the rounding as distance travelled:
    # its estimate d grew to 2.7x optax's in two steps (16x in one with 8-bit state)
    params = {"w": jnp.asarray(RNG_STEPS[-1] / 10, F32)}
    exact = third_party.optimizer(optax.contrib.prodigy(1.0))
    tx = jaxscale.low_precision_state(third_party.optimizer(optax.contrib.prodigy(1.0)), BF16)
    state, exact_state, p, exact_p = tx.init(params), exact.init(params), params, params
    for index in range(4):
        updates, state = jax.jit(tx.update)(jax.grad(regression_loss)(p, index), state, p)
        exact_grads = jax.grad(regression_loss)(exact_p, index)
        exact_updates, exact_state = jax.jit(exact.update)(exact_grads, exact_state, exact_p)
        p, exact_p = apply(p, updates), apply(exact_p, exact_updates)
        assert state.inner_state.estim_lr == exact_state.estim_lr, index
        error = jnp.linalg.norm(updates["w"] - exact_updates["w"])
        assert error < 0.01 * jnp.linalg.norm(exact_updates["w"]), index


def lookahead():
    return third_party.optimizer(optax.lookahead(optax.adam(1e-2), 2, 0.5))


LOOKAHEAD_CASES = {
    "low_precision_state bfloat16": (F32, lambda: jaxscale.low_precision_state(lookahead())),
    "low_precision_state int8": (F32, lambda: jaxscale.low_precision_state(lookahead(), "int8")),
    "grad_scaler": (
        F32, lambda: jaxscale.grad_scaler(jaxscale.low_precision_state(lookahead(), "int8"))
    ),
    "master_weights": (BF16, lambda: jaxscale.master_weights(lookahead())),
    "stochastic_rounding": (
        BF16, lambda: jaxscale.stochastic_rounding(lookahead(), key=jax.random.key(0))
    ),
    "kahan_summation": (BF16, lambda: jaxscale.kahan_summation(lookahead())),
}  # fmt: skip


@pytest.mark.parametrize("name", list(LOOKAHEAD_CASES))
def test_lookahead_whose_updates_are_not_shaped_as_its_gradients_steps_inside(name):
    # optax.lookahead steps LookaheadParams (fast and slow) from the fast ones' gradients:
    # the transforms that put their results back into the gradients' structure raised
    dtype, make = LOOKAHEAD_CASES[name]
    fast = {"w": jnp.asarray(RNG_STEPS[-1] / 10, BF16).astype(dtype)}
    params = optax.LookaheadParams.init_synced(fast)
    exact_params = jax.tree.map(lambda p: p.astype(F32), params)
    tx, exact = make(), lookahead()
    state, exact_state = tx.init(params), exact.init(exact_params)
    for index in range(4):
        grads = {"w": jnp.asarray(RNG_STEPS[index], dtype)}
        scale = jaxscale.get_scale(state) if name == "grad_scaler" else 1  # (a scaled loss's)
        scaled = {"w": grads["w"] * jnp.asarray(scale, dtype)}
        updates, state = jax.jit(tx.update)(scaled, state, params)
        exact_updates, exact_state = exact.update(
            jax.tree.map(lambda g: g.astype(F32), grads), exact_state, exact_params
        )
        params, exact_params = apply(params, updates), apply(exact_params, exact_updates)
    assert {p.dtype for p in jax.tree.leaves(params)} == {jnp.dtype(dtype)}
    moved = jnp.max(jnp.abs(exact_params.slow["w"] - fast["w"].astype(F32)))
    if name == "master_weights":  # the masters follow float32's steps
        got = jaxscale.master_params(state, params)
        np.testing.assert_allclose(got.slow["w"], exact_params.slow["w"], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(got.fast["w"], exact_params.fast["w"], rtol=1e-6, atol=1e-7)
    # bfloat16 parameters: each step rounds to the parameter's precision (a stochastic
    # rounding may land an ulp further), so a few ulps of the largest apart
    largest = float(jnp.max(jnp.abs(exact_params.slow["w"])))
    bound = 0.1 * moved if dtype == F32 else 4 * 2.0 ** (np.floor(np.log2(largest)) - 7)
    for part in ("slow", "fast"):
        error = jnp.max(jnp.abs(getattr(params, part)["w"].astype(F32) - getattr(
            exact_params, part)["w"]))  # fmt: skip
        assert error <= bound, (part, float(error), float(moved))


@pytest.mark.parametrize("dtype", ["int8", "bfloat16"])
def test_half_precision_gradients_are_widened_as_torchao_widens_them(dtype):
    # torchao's optimizers upcast their gradients; here bfloat16 gradients met the
    # widened state in bfloat16 products (Adam's g * g rounded to bfloat16), and a float32
    # update broke optax.apply_if_finite, whose rejecting branch returns bfloat16 zeros
    params = {"w": jnp.asarray(RNG_STEPS[-1] / 10, BF16)}
    grads = {"w": jnp.asarray(RNG_STEPS[0], BF16)}
    tx = jaxscale.low_precision_state(adamw(), dtype)
    state = tx.init(params)
    narrow = jax.jit(tx.update)(grads, state, params)
    wide = jax.jit(tx.update)(jax.tree.map(lambda g: g.astype(F32), grads), state, params)
    for a, b in zip(jax.tree.leaves(narrow), jax.tree.leaves(wide), strict=True):
        np.testing.assert_array_equal(bits(a), bits(b))

    guarded = jaxscale.low_precision_state(
        third_party.optimizer(optax.apply_if_finite(adamw(), 3)), dtype
    )
    updates, _ = jax.jit(guarded.update)(grads, guarded.init(params), params)
    np.testing.assert_array_equal(bits(updates["w"]), bits(narrow[0]["w"]))


def test_a_parameter_named_nu_keeps_a_signed_first_moment():
    # the unsigned map is for optax's second-moment fields, not for a parameter that
    # happens to share their name: two identical parameters step alike, whatever their names
    w = jnp.asarray(RNG_STEPS[-1] / 10, F32)
    params = {"nu": w, "w": w}
    tx = jaxscale.low_precision_state(adamw(), "int8")
    state = tx.init(params)
    for index in range(3):
        grads = {"nu": jnp.asarray(RNG_STEPS[index], F32), "w": jnp.asarray(RNG_STEPS[index], F32)}
        updates, state = jax.jit(tx.update)(grads, state, params)
        np.testing.assert_array_equal(updates["nu"], updates["w"])
    mu, nu = state.inner_state[0].mu, state.inner_state[0].nu
    np.testing.assert_array_equal(mu["nu"].codes, mu["w"].codes)
    np.testing.assert_array_equal(nu["nu"].codes, nu["w"].codes)


def momentum_error(state_of, stored, exact):
    """The relative error of a stored leaf read with the signed map, against optax's."""
    leaf = state_of(stored)["w"]
    read = jaxscale.dequantize_blockwise(leaf.codes, leaf.scale, "int8", signed=True)
    expected = state_of(exact)["w"]
    return float(jnp.linalg.norm(read - expected) / jnp.linalg.norm(expected))


SECOND_MOMENT_CASES = {
    # optimizer, the second moment in its state
    "momo_adam": (lambda: optax.contrib.momo_adam(1e-2), lambda s: s[0].exp_avg_sq),
    "adagrad": (lambda: optax.adagrad(1e-2), lambda s: s[0][0].sum_of_squares),
    "madgrad": (lambda: optax.contrib.madgrad(1e-2), lambda s: s[0][1].grad_sum_sq),
    "amsgrad": (lambda: optax.amsgrad(1e-2), lambda s: s[0][0].nu_max),
}


@pytest.mark.parametrize("name", list(SECOND_MOMENT_CASES))
def test_second_moments_under_their_other_names_are_stored_unsigned(name):
    # the unsigned map spends all its codes on values >= 0: read back with it, the stored
    # second moment is within the map's error of optax's (with the signed map, half the
    # codes would go unused, and reading it as unsigned would give other numbers)
    make, state_of = SECOND_MOMENT_CASES[name]
    if name == "madgrad" and not hasattr(optax.contrib, "madgrad"):
        pytest.skip("optax.contrib.madgrad arrived in optax 0.2.5")
    params = {"w": jnp.asarray(RNG_STEPS[-1] / 10, F32)}
    exact = third_party.optimizer(make())
    tx = jaxscale.low_precision_state(third_party.optimizer(make()), "int8")
    state, exact_state = tx.init(params), exact.init(params)
    for index in range(2):
        grads = {"w": jnp.asarray(RNG_STEPS[index], F32)}
        extra = {"value": regression_loss(params, index)} if name == "momo_adam" else {}
        state = tx.update(grads, state, params, **extra)[1]
        exact_state = exact.update(grads, exact_state, params, **extra)[1]
    leaf = state_of((state.inner_state,))["w"]
    read = jaxscale.dequantize_blockwise(leaf.codes, leaf.scale, "int8", signed=False)
    expected = state_of((exact_state,))["w"]
    assert float(jnp.min(expected)) >= 0
    error = jnp.linalg.norm(read - expected) / jnp.linalg.norm(expected)
    assert error < 0.03, float(error)


def test_sm3_and_sophia_keep_their_signed_nu_signed():
    # SM3's nu is its momentum, Sophia's an estimate of the Hessian's diagonal: both take
    # negative values, which the unsigned map would store as zero
    params = {"w": jnp.asarray(RNG_STEPS[-1] / 10, F32)}

    def loss(params):
        return regression_loss(params, 1)

    cases = {"sm3": (lambda: optax.sm3(1e-2, momentum=0.9), lambda s: s[0].nu, {})}
    if hasattr(optax.contrib, "sophia"):  # (optax 0.2.5 and later)
        cases["sophia"] = (
            lambda: optax.contrib.sophia(1e-2, update_interval=1),
            lambda s: s[0].nu,
            {"obj_fn": loss},
        )
    for name, (make, state_of, extra) in cases.items():
        exact = third_party.optimizer(make())
        tx = jaxscale.low_precision_state(third_party.optimizer(make()), "int8")
        state, exact_state = tx.init(params), exact.init(params)
        for _ in range(3):
            grads = jax.grad(loss)(params)
            state = tx.update(grads, state, params, **extra)[1]
            exact_state = exact.update(grads, exact_state, params, **extra)[1]
        assert float(jnp.mean(state_of(exact_state)["w"] < 0)) > 0.1, name
        assert momentum_error(state_of, state.inner_state, exact_state) < 0.03, name


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn", "int4"])
def test_a_state_the_update_leaves_as_it_was_is_stored_as_it_was(dtype):
    # quantizing a block's dequantized values again need not give its codes and scale back
    # (the signed map's ends are not symmetric), so a state passed through unchanged is
    # kept as stored: on whole arrays (a non-elementwise optimizer) and in slices
    params = {"w": jnp.asarray(RNG_STEPS[-1] / 10, F32)}
    grads = {"w": jnp.asarray(RNG_STEPS[0], F32)}
    state = jaxscale.low_precision_state(adamw(), dtype).init(params)
    state = jaxscale.low_precision_state(adamw(), dtype).update(grads, state, params)[1]

    def passing_through(update):
        return optax.GradientTransformation(adamw().init, update)

    elementwise = passing_through(lambda u, s, p=None: (u, s))
    whole = passing_through(lambda u, s, p=None: (jax.tree.map(jnp.flip, u), s))
    for inner in (elementwise, whole):
        tx = jaxscale.low_precision_state(inner, dtype)
        kept = jax.jit(tx.update)(grads, state, params)[1]
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(kept), strict=True):
            np.testing.assert_array_equal(
                np.asarray(a).reshape(-1).view(np.uint8), np.asarray(b).reshape(-1).view(np.uint8)
            )
