"""The low-precision state as a big model meets it: the compiled step's peak memory, the
time to compile ``jax.jit(tx.init)``, FSDP-sharded steps on 8 devices, checkpoints moved
between meshes, and every leaf quantized on request.

Memory is read from ``memory_analysis()`` of steps compiled on abstract shapes
(``jax.ShapeDtypeStruct``), so nothing of the model's size is allocated: arguments
(parameters, gradients, state), temporaries, and outputs not written into a donated
argument.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support import machine, third_party

import jaxscale
from jaxscale._src import cpu_backend
from jaxscale._src.deferred import derived_elementwise, elementwise_origin
from jaxscale._src.elementwise import ElementwiseProgram
from jaxscale.optim import _blockwise, _in_place, _master_weights, _widened

F32, BF16 = jnp.float32, jnp.bfloat16
FORMATS = ["int8", "float8_e4m3fn", "int4", "bfloat16"]


def adamw():
    return third_party.optimizer(optax.adamw(1e-3, weight_decay=1e-2))


def adam():
    return third_party.optimizer(optax.adam(1e-3))


# The steps whose memory the tests read: 10M parameters in 10 leaves. The temporaries
# are a slice's, per leaf, so the bytes per parameter are those of the 50 leaves that
# `python -m benchmarks.optimizer_state --memory-only` measures (int8 2.031 against
# 2.032, float8 2.23 against 2.21), at a fifth of the compile time.
TEN_M = (10e6, 10)


def layout(parameters: float, leaves: int, dtype=F32):
    size = int(parameters) // leaves // 256 * 256
    return {f"p{i:03d}": jax.ShapeDtypeStruct((size,), dtype) for i in range(leaves)}


def bytes_of(array):
    """An array's bytes (a PRNG key's by its key data), for bitwise comparisons."""
    if jnp.issubdtype(array.dtype, jax.dtypes.prng_key):
        array = jax.random.key_data(array)
    return np.asarray(array).reshape(-1).view(np.uint8)


def step_memory(tx, params):
    """Bytes per parameter of the compiled, donated ``update`` + ``apply_updates`` step:
    (arguments, temporaries, outputs not aliased to an argument)."""
    state = jax.eval_shape(tx.init, params)

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        with third_party.standard_promotion():
            return optax.apply_updates(params, updates), state

    compiled = machine.compiled_to_inspect(
        jax.jit(step, donate_argnums=(0, 1)).lower(params, state, params)
    )
    memory = compiled.memory_analysis()
    count = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))
    unaliased = memory.output_size_in_bytes - memory.alias_size_in_bytes
    return (
        memory.argument_size_in_bytes / count,
        memory.temp_size_in_bytes / count,
        unaliased / count,
    )


# -- the elementwise program --------------------------------------------------------------------


def flat_update(tx, params):
    state = tx.init(params)
    leaves, tree = jax.tree.flatten((params, state, params))

    def fn(*xs):
        grads, state, params = jax.tree.unflatten(tree, xs)
        return jax.tree.leaves(tx.update(grads, state, params))

    return fn, leaves


def test_an_elementwise_optimizer_reads_as_one_component_per_parameter():
    params = {"w": jnp.ones((8, 4)), "b": jnp.ones(4)}
    clipped = third_party.optimizer(optax.chain(optax.clip_by_global_norm(1.0), adamw()))
    fn, leaves = flat_update(clipped, params)
    program = ElementwiseProgram.read(fn, *leaves)
    assert program is not None  # the global norm is a scalar, computed on whole arrays
    outputs = [program.component_of(v) for v in program.outvars]
    # updates b, w; then the state: count (a scalar), mu b, mu w, nu b, nu w
    assert outputs[0] == outputs[3] == outputs[5] != outputs[1] == outputs[4] == outputs[6]
    assert outputs[2] is None


def orthogonalising():
    """An optimizer whose update multiplies the gradient matrix by itself, as Muon's
    Newton-Schulz step does (optax.contrib.muon is not in every optax jaxscale supports)."""

    def update(updates, state, params=None):
        return jax.tree.map(lambda g: g @ g.T @ g, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def looping():
    """An optimizer that halves its update as many times as the step count says."""

    def update(updates, state, params=None):
        def halve(_, g):
            return g * 0.5

        return jax.tree.map(lambda g: jax.lax.fori_loop(0, state, halve, g), updates), state + 1

    return optax.GradientTransformation(lambda params: jnp.zeros((), jnp.int32), update)


@pytest.mark.parametrize(
    "make",
    [
        lambda: optax.adafactor(1e-3),  # factored moments (rows and columns of 128 or more)
        lambda: orthogonalising(),  # matrix products, as Muon's
        lambda: looping(),  # a loop of a trip count the step computes
    ],
    ids=["adafactor", "matrix products", "loop"],
)
def test_an_optimizer_that_is_not_elementwise_is_refused(make):
    params = {"w": jnp.ones((256, 128))}
    fn, leaves = flat_update(third_party.optimizer(make()), params)
    assert ElementwiseProgram.read(fn, *leaves) is None


def test_a_component_evaluated_on_slices_is_the_whole_evaluation_sliced():
    params = {"w": jax.random.normal(jax.random.key(0), (16, 8))}
    fn, leaves = flat_update(adamw(), params)
    program = ElementwiseProgram.read(fn, *leaves)
    outputs, values = program.evaluate(leaves)
    component = program.component_of(program.outvars[0])
    inputs = program.array_inputs(component)
    rows = [leaf.reshape(4, 32) if leaf.ndim else leaf for leaf in leaves]
    for row in range(4):
        arrays = {v: rows[program.invars.index(v)][row] for v in inputs}
        wanted = [v for v in program.outvars if program.component_of(v) == component]
        pieces = program.evaluate_slice(component, wanted, arrays, values, (32,))
        expected = [outputs[program.outvars.index(v)].reshape(4, 32)[row] for v in wanted]
        for got, want in zip(pieces, expected, strict=True):
            np.testing.assert_array_equal(got, want)


def test_random_bits_are_hashed_from_a_strided_slices_positions():
    # bits drawn elementwise (an iota of the whole shape, hashed) are the component's
    # arrays, not computed whole: a slice of every fourth row computes its own
    key = jax.random.key(7)

    def fn(x):
        return [x + jaxscale.stochastic_round(x, key=key).astype(F32)]

    x = jax.random.normal(jax.random.key(0), (8, 2, 16))
    program = ElementwiseProgram.read(fn, x)
    assert program is not None
    assert all(v.aval.shape != x.shape for v in program.whole)  # (the key's words are)
    (whole,), values = program.evaluate([x])
    component = program.component_of(program.outvars[0])
    rows = x.reshape(2, 4, 32)  # 8 rows of 32, read as (group, iterations, row)
    expected = np.asarray(whole).reshape(2, 4, 32)
    for step in range(4):

        def positions(step=step):
            row = np.arange(2, dtype=np.uint32)[:, None] * 4 + step
            return jnp.asarray(row * 32 + np.arange(32, dtype=np.uint32))

        (got,) = program.evaluate_slice(
            component, program.outvars, {program.invars[0]: rows[:, step]}, values, (2, 32),
            positions,
        )  # fmt: skip
        np.testing.assert_array_equal(got, expected[:, step])


# -- slices and whole arrays agree --------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_step_in_slices_stores_what_a_step_on_whole_arrays_stores(fmt, monkeypatch):
    params = {
        "w": jax.random.normal(jax.random.key(0), (96, 256)) * 0.1,
        "v": jax.random.normal(jax.random.key(1), (8192,)),
    }
    tx = jaxscale.low_precision_state(adamw(), fmt)

    def run():
        state = tx.init(params)
        step = jax.jit(tx.update)
        current = params
        for index in range(3):
            grads = jax.tree.map(lambda p, k=index: jnp.sin(p * (k + 1)), current)
            updates, state = step(grads, state, current)
            current = jax.tree.map(jnp.add, current, updates)
        return current, state

    whole_params, whole_state = run()
    monkeypatch.setattr(_in_place, "CPU_SLICE", 1024)  # every leaf in 4 to 96 iterations
    sliced_params, sliced_state = run()
    for a, b in zip(jax.tree.leaves(whole_state), jax.tree.leaves(sliced_state), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(bytes_of(a), bytes_of(b))
    for a, b in zip(jax.tree.leaves(whole_params), jax.tree.leaves(sliced_params), strict=True):
        np.testing.assert_array_equal(a, b)


WRITERS = {
    "stochastic_rounding": (
        BF16,
        lambda: jaxscale.stochastic_rounding(adamw(), key=jax.random.key(0)),
    ),
    "kahan_summation": (BF16, lambda: jaxscale.kahan_summation(adamw())),
    "stochastic_rounding, float32 state": (
        BF16,
        lambda: jaxscale.stochastic_rounding(
            adamw(), key=jax.random.key(0), state_dtype=jnp.float32
        ),
    ),
    "bfloat16 state": (F32, lambda: jaxscale.low_precision_state(adamw(), "bfloat16")),
    "grad_scaler(kahan_summation)": (
        BF16,
        lambda: jaxscale.grad_scaler(jaxscale.kahan_summation(adamw()), init_scale=2.0**4),
    ),
}


def loops_over_bfloat16(monkeypatch, loops):
    """The platform's answer replaced: whether a step loops over a bfloat16 state."""
    monkeypatch.setattr(_in_place, "slices_bfloat16_in_place", lambda: loops)
    monkeypatch.setattr(_widened, "loops_over_bfloat16", lambda: loops)


def sine_training_step(tx):
    """A jitted training step ``(params, state, scale) -> (params, state)`` whose
    gradients, ``sin(p * scale)``, are computed in it and written out in their dtype,
    as a layer's are (else XLA may keep a bfloat16 sine in float32 where it fuses it
    into a conversion: excess precision, in one program and not another)."""

    @jax.jit
    def step(params, state, scale):
        grads = jax.tree.map(lambda p: jnp.sin(p * scale.astype(p.dtype)), params)
        grads = jax.lax.optimization_barrier(grads)
        updates, state = tx.update(grads, state, params)
        with third_party.standard_promotion():
            return optax.apply_updates(params, updates), state

    return step


@pytest.mark.parametrize("gradients", ["computed", "passed"])
@pytest.mark.parametrize("name", list(WRITERS))
def test_a_half_precision_step_in_slices_writes_what_it_writes_whole(name, gradients, monkeypatch):
    # In a training step, the bfloat16 state and the parameters stochastic rounding and
    # Kahan summation write are computed slice by slice (strided: every 4th to 96th row),
    # each new half-precision parameter written into its gradient's buffer (with the
    # gradients passed to the step, into a buffer of its own), the random bits hashed
    # from each slice's positions: what a step on whole arrays writes.
    dtype, make = WRITERS[name]
    params = {
        "w": (jax.random.normal(jax.random.key(0), (96, 256)) * 0.1).astype(dtype),
        "v": jax.random.normal(jax.random.key(1), (8192,)).astype(dtype),
        "s": jnp.float32(0.5),  # a float32 scalar beside them
    }
    looped = []  # each loop of several iterations that wrote updates into gradients
    original = _in_place._loop

    def counting(*args):
        if args[11] > 1 and args[13]:  # (iterations, the updates written)
            looped.append(len(args[13]))
        return original(*args)

    monkeypatch.setattr(_in_place, "_loop", counting)

    def run():
        tx = make()
        step = sine_training_step(tx)
        if gradients == "passed":
            update = jax.jit(tx.update)

            def step(params, state, scale):
                grads = jax.tree.map(lambda p: jnp.sin(p * scale.astype(p.dtype)), params)
                updates, state = update(grads, state, params)
                with third_party.standard_promotion():
                    return optax.apply_updates(params, updates), state

        current, state = params, tx.init(params)
        scaled = name.startswith("grad_scaler")  # (infinite gradients, which it skips)
        for scale in [1.0, 2.0, float("inf"), 3.0] if scaled else [1.0, 2.0, 3.0]:
            current, state = step(current, state, jnp.float32(scale))
        assert all(bool(jnp.isfinite(p).all()) for p in jax.tree.leaves(current))
        return current, state

    loops_over_bfloat16(monkeypatch, False)
    whole = run()
    assert looped == []
    loops_over_bfloat16(monkeypatch, True)
    monkeypatch.setattr(_in_place, "CPU_SLICE", 1024)
    sliced = run()
    # both leaves' updates went through the loop (a float32 state needs none: the update
    # reads the new moments, written whole where the old ones were; a float32 update of
    # a bfloat16 state, passed, would take a buffer as large as the copy it saves)
    if "float32 state" in name or (gradients == "passed" and name == "bfloat16 state"):
        assert looped == []
    else:
        assert len(looped) >= 2
    # The same arithmetic, but XLA contracts a multiplication and an addition into one
    # rounding in some fusions and not others (the float32 moments of a whole-array step
    # and of a slice's are computed in different ones), so a float32 value can be a last
    # bit apart and, rounded to bfloat16, a few moments a bit apart, then a parameter up
    # to two (Kahan), with the compensation holding the difference. (Measured: stochastic
    # rounding and Kahan bit for bit on JAX 0.10.2; the bfloat16 state 75 bytes of
    # 32768 apart, grad_scaler(kahan) 3 of 49152 on JAX 0.12.1.) Anything else (a slice's
    # random bits drawn for another position, say) moves most of them.
    paths = jax.tree_util.tree_flatten_with_path(whole)[0]
    for (path, a), b in zip(paths, jax.tree.leaves(sliced), strict=True):
        assert a.dtype == b.dtype
        if not jnp.issubdtype(a.dtype, jnp.floating):  # counts, keys: bit for bit
            np.testing.assert_array_equal(bytes_of(a), bytes_of(b))
            continue
        where = jax.tree_util.keystr(path)
        half = a.dtype.itemsize == 2
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if "compensation" in where:  # (compared below, with its parameter)
            continue
        if half:  # a bfloat16 ulp or two apart, rarely
            np.testing.assert_allclose(a, b, rtol=2**-6, atol=0, err_msg=where)
            assert np.mean(a != b) < 0.005, where
        else:
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=2e-9, err_msg=where)
    # Kahan tracks a parameter plus its compensation: apart by what rounding the
    # compensation (about 1e-3 here) to bfloat16 loses, far below the parameter's ulp
    for a, b in zip(kahan_sums(whole), kahan_sums(sliced), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=2**-15)


def kahan_sums(result):
    """Each half-precision parameter plus its Kahan compensation, in float32 (none
    without Kahan summation)."""
    params, state = result
    paths = jax.tree_util.tree_flatten_with_path(state)[0]
    compensations = [leaf for path, leaf in paths if "compensation" in jax.tree_util.keystr(path)]
    halves = [p for p in jax.tree.leaves(params) if p.dtype.itemsize == 2]
    if not compensations:
        return []
    return [
        np.asarray(p, np.float32) + np.asarray(c, np.float32)
        for p, c in zip(halves, compensations, strict=True)
    ]


def test_the_cpu_backend_is_asked_whether_it_slices_bfloat16_in_place():
    # XLA's CPU backend slices bfloat16 in place from jaxlib 0.11.2 on (0.11.1 and
    # 0.10.2 widen the whole array for each slice, measured)
    import jaxlib

    version = tuple(int(part) for part in re.findall(r"\d+", jaxlib.__version__)[:3])
    assert cpu_backend.slices_bfloat16_in_place() == (version >= (0, 11, 2))


def test_the_backend_is_asked_the_same_under_a_mesh_with_explicit_axes():
    # a step traced under jax.set_mesh (explicit axes: Flax's sharding guides) asked the
    # question inside its own trace, where the probe's values took the mesh's axes and
    # its operand none: a sharding type error, before anything was computed
    import jaxlib

    version = tuple(int(part) for part in re.findall(r"\d+", jaxlib.__version__)[:3])
    probe = cpu_backend.slices_bfloat16_in_place.__wrapped__  # (uncached)
    explicit = (jax.sharding.AxisType.Explicit,) * 2
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=explicit)
    with jax.set_mesh(mesh):
        assert probe() == (version >= (0, 11, 2))
        assert bool(jax.jit(lambda: jnp.asarray(probe()))()) == (version >= (0, 11, 2))
        # replicated arrays under that mesh step as anywhere
        tx = jaxscale.low_precision_state(adamw(), "int8")
        params = {"w": jnp.ones((64, 4096))}
        jax.jit(tx.update)(params, tx.init(params), params)


# -- peak memory --------------------------------------------------------------------------------


def test_the_8_bit_and_float8_steps_peak_below_float32_adams():
    params = layout(*TEN_M)
    _, baseline_temporaries, _ = step_memory(adamw(), params)
    baseline = sum(step_memory(adamw(), params))
    assert baseline == pytest.approx(16.0, abs=0.01)  # parameters, gradients, two moments
    assert baseline_temporaries < 0.01
    count = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))
    for fmt, at_rest in [("int8", 10.03), ("float8_e4m3fn", 10.03), ("int4", 9.06)]:
        tx = jaxscale.low_precision_state(adamw(), fmt)
        arguments, temporaries, unaliased = step_memory(tx, params)
        state = sum(leaf.size * leaf.dtype.itemsize
                    for leaf in jax.tree.leaves(jax.eval_shape(tx.init, params)))  # fmt: skip
        assert 8 + state / count == pytest.approx(at_rest, abs=0.01), fmt  # + params, grads
        # JAX 0.12.1 passes a program's large constants as arguments: the 8-bit
        # encoder's two lookup tables of 2**16 int32 (_blockwise.py) and a few scalars,
        # once per step
        assert 0 <= arguments - (8 + state / count) <= (2 * 2**16 * 4 + 1024) / count, fmt
        assert unaliased < 0.01, fmt  # the new state is written into the donated old one
        # the old state, kept while the new one is written (Optax applies the update
        # after the transform returns it), and a slice's temporaries
        assert temporaries < 2.3 if fmt != "int4" else temporaries < 1.3, fmt
        assert arguments + temporaries + unaliased < 0.8 * baseline, fmt


@pytest.mark.parametrize("fmt", FORMATS)
def test_temporaries_stay_a_constant_per_parameter_with_large_leaves(fmt):
    # 32M parameters in 4 leaves: a whole-array step held 16 bytes per parameter
    _, temporaries, _ = step_memory(jaxscale.low_precision_state(adamw(), fmt), layout(32e6, 4))
    assert temporaries <= {"int8": 2.1, "float8_e4m3fn": 2.4, "int4": 1.1, "bfloat16": 4.01}[fmt]


def in_step_memory(tx, params):
    """Bytes per parameter of a donated training step whose gradients are computed in it
    (from a matmul, as a layer's are, so that XLA writes them out): (arguments,
    temporaries). The gradients are temporaries of the step."""
    state = jax.eval_shape(tx.init, params)

    def step(params, state, mixing):
        grads = jax.tree.map(
            lambda p: (p.reshape(-1, 256) @ mixing.astype(p.dtype)).reshape(p.shape), params
        )
        updates, state = tx.update(grads, state, params)
        with third_party.standard_promotion():
            return optax.apply_updates(params, updates), state

    mixing = jax.ShapeDtypeStruct((256, 256), F32)
    compiled = machine.compiled_to_inspect(
        jax.jit(step, donate_argnums=(0, 1)).lower(params, state, mixing)
    )
    memory = compiled.memory_analysis()
    count = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))
    return memory.argument_size_in_bytes / count, memory.temp_size_in_bytes / count


def test_a_training_steps_state_costs_little_beyond_its_gradients():
    # The gradients a step computes are its own buffers: each update is written into its
    # gradient's, slice by slice, so nothing reads the old state after the loop and XLA
    # keeps no copy of it. Float32 Adam's step holds its gradients (4 bytes) and nothing
    # else; the 8-bit and float8 states held 2 bytes more, the 4-bit state 1, the bfloat16
    # state 4.
    params = layout(*TEN_M)
    arguments, temporaries = in_step_memory(adamw(), params)
    assert temporaries == pytest.approx(4.0, abs=0.01)
    baseline = arguments + temporaries
    # (float8's 1.5: its codes' uint8 views, which XLA's CPU backend writes as copies;
    # the bfloat16 state's 4: the copy, where the CPU backend cannot loop over it)
    looped = cpu_backend.slices_bfloat16_in_place()
    beyond = {"int8": 0.2, "float8_e4m3fn": 1.6, "int4": 0.2, "bfloat16": 0.1 if looped else 4.01}
    for fmt, bound in beyond.items():
        tx = jaxscale.low_precision_state(adamw(), fmt)
        arguments, temporaries = in_step_memory(tx, params)
        assert temporaries - 4.0 < bound, fmt
        if fmt != "bfloat16":
            assert arguments + temporaries < 0.75 * baseline, fmt
    tx = jaxscale.grad_scaler(jaxscale.low_precision_state(adamw(), "int8"))
    assert in_step_memory(tx, params)[1] - 4.0 < 0.2


def test_a_training_step_writes_half_precision_parameters_in_place():
    # Stochastic rounding and Kahan summation on bfloat16 parameters, beyond optax.adamw's
    # own step on them (its gradients, and on the CPU a matmul's float32 operand): a
    # whole-array step keeps a copy of the old bfloat16 moments (4 bytes/param) and, for
    # Kahan, float32 sums; in slices, nothing of the parameters' size
    params = layout(*TEN_M, dtype=BF16)
    _, baseline = in_step_memory(adamw(), params)
    looped = cpu_backend.loops_over_bfloat16()
    bounds = {
        "stochastic_rounding": 0.1 if looped else 4.1,
        "kahan_summation": 0.1 if looped else 3.4,
    }
    for name, bound in bounds.items():
        _, temporaries = in_step_memory(WRITERS[name][1](), params)
        assert temporaries - baseline < bound, name
    # with the gradients passed (arguments, which the loop cannot write into), the new
    # parameters take a bfloat16 buffer of their own: 2 bytes and a slice's, where the
    # whole-array step keeps the old moments (4) and, for Kahan, float32 sums (6.2 in
    # these 10 leaves)
    for name, bound in {"stochastic_rounding": 4.01, "kahan_summation": 6.3}.items():
        _, temporaries, _ = step_memory(WRITERS[name][1](), params)
        assert temporaries < (2.1 if looped else bound), name
    # master_weights' step in the 8-bit state's loop (where the CPU backend widens
    # bfloat16 slices, the new parameters pass through the loop as uint16: 0.59)
    tx = jaxscale.master_weights(jaxscale.low_precision_state(adamw(), "int8"))
    _, temporaries = in_step_memory(tx, params)
    assert temporaries - baseline < (0.2 if looped else 0.7)  # (0.14 in these 10 leaves)


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_update_written_into_its_gradients_buffer_is_the_update_computed_whole(fmt, monkeypatch):
    # the same step with its gradients passed (the update computed on whole arrays,
    # outside the loop) and computed in it (the update written into the gradients'
    # buffer, in 4 to 96 iterations): the same codes bit for bit, the scales and the
    # parameters to float32's rounding (XLA fuses the update into the addition that
    # applies it in one, and adds it after the loop in the other: a last bit apart where
    # it contracts a multiplication and an addition into one rounding)
    params = {
        "w": jax.random.normal(jax.random.key(0), (96, 256)) * 0.1,
        "v": jax.random.normal(jax.random.key(1), (8192,)),
    }
    monkeypatch.setattr(_in_place, "CPU_SLICE", 1024)
    tx = jaxscale.grad_scaler(jaxscale.low_precision_state(adamw(), fmt), init_scale=2.0**4)

    def apply(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return jax.tree.map(jnp.add, params, updates), state

    given = jax.jit(apply)

    @jax.jit
    def in_step(params, state, scale):
        # times a power of two (or infinity): exactly the passed gradients; not through
        # the jitted `given`, in whose trace they would be its arguments again
        return apply(params, state, jax.tree.map(lambda p: p * scale, params))

    current, state = params, tx.init(params)
    for scale in [1.0, 0.5, float("inf"), 2.0]:  # the third step's gradients overflow
        expected = given(current, state, jax.tree.map(lambda p, s=scale: p * s, current))
        got = in_step(current, state, jnp.float32(scale))
        for a, b in zip(jax.tree.leaves(expected[1]), jax.tree.leaves(got[1]), strict=True):
            if jnp.issubdtype(a.dtype, jnp.floating) and a.dtype.itemsize == 4:
                # the blocks' float32 scales: the new moments they are the maxima of are
                # computed in another fusion beside the update, a last bit apart at most
                np.testing.assert_allclose(a, b, rtol=2.5e-7, atol=0)
            else:  # the codes, the counts, the bfloat16 moments: bit for bit
                np.testing.assert_array_equal(bytes_of(a), bytes_of(b))
        for a, b in zip(jax.tree.leaves(expected[0]), jax.tree.leaves(got[0]), strict=True):
            np.testing.assert_allclose(a, b, rtol=2e-7, atol=1e-9)
        if scale == float("inf"):  # skipped: nothing moved
            for a, b in zip(jax.tree.leaves(current), jax.tree.leaves(got[0]), strict=True):
                np.testing.assert_array_equal(a, b)
        current, state = expected
    assert int(state.scaler.skipped_steps) == 1


def test_an_update_is_written_into_the_gradients_buffer_only_when_it_is_the_steps_own():
    # A passed gradient is an argument of the compiled program, which XLA would copy to
    # write into: the update is computed on whole arrays. Under master_weights the
    # bfloat16 gradients' buffers take the new bfloat16 parameters (its step handed down
    # to the loop), where a float32 update would not fit them.
    written = set()  # how many updates a loop writes into gradients' buffers
    original = _in_place._loop

    def counting(*args):
        written.add(len(args[13]))  # the updates written into gradients' buffers
        return original(*args)

    params = {"w": jnp.ones((512, 256))}
    tx = jaxscale.low_precision_state(adamw(), "int8")
    bf16 = jaxscale.master_weights(tx)
    half = {"w": params["w"].astype(BF16)}

    def times_two(tree):
        return jax.tree.map(lambda x: x * 2, tree)

    def written_by(trace):
        written.clear()
        trace()
        return written.copy()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_in_place, "_loop", counting)
        update = jax.jit(tx.update)
        assert written_by(lambda: update.lower(params, tx.init(params), params)) == {0}
        in_step = jax.jit(lambda p, s: tx.update(times_two(p), s, p))
        assert written_by(lambda: in_step.lower(params, tx.init(params))) == {1}
        assert written_by(lambda: tx.update(params, tx.init(params), params)) == {0}  # eager
        master = jax.jit(lambda p, s: bf16.update(times_two(p), s, p))
        assert written_by(lambda: master.lower(half, bf16.init(half))) == {1}
        master_given = jax.jit(bf16.update)
        assert written_by(lambda: master_given.lower(half, bf16.init(half), half)) == {0}


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn", "int4"])
def test_a_training_step_lowered_for_a_gpu_waits_on_nothing(fmt):
    # a leaf of 8M elements: on a GPU two slices of 4M, the update written into the
    # gradient's buffer by a loop of known trip count; under a loss scaler's skip
    params = {"w": jax.ShapeDtypeStruct((4096, 2048), F32)}
    tx = jaxscale.grad_scaler(jaxscale.low_precision_state(adamw(), fmt))

    def step(params, state, scale):
        grads = jax.tree.map(lambda p: jnp.sin(p) * scale, params)
        updates, state = tx.update(grads, state, params)
        return jax.tree.map(jnp.add, params, updates), state

    state = jax.eval_shape(tx.init, params)
    report = jaxscale.lowering_report(step, params, state, jax.ShapeDtypeStruct((), F32))
    assert not report.syncs_with_host, report
    assert report.loops == report.counted_loops >= 1


@pytest.mark.parametrize("name", ["stochastic_rounding", "kahan_summation", "bfloat16 state"])
def test_a_half_precision_training_step_lowered_for_a_gpu_waits_on_nothing(name):
    # the bfloat16 state, and the parameters stochastic rounding and Kahan write, in a
    # loop of known trip count on a GPU (where the step is traced on a CPU whose backend
    # cannot loop over bfloat16, stochastic rounding and Kahan are computed whole)
    dtype, make = WRITERS[name]
    params = {"w": jax.ShapeDtypeStruct((4096, 2048), dtype)}
    tx = jaxscale.grad_scaler(make())

    def step(params, state, scale):
        grads = jax.tree.map(lambda p: jnp.sin(p) * scale.astype(p.dtype), params)
        updates, state = tx.update(grads, state, params)
        with third_party.standard_promotion():
            return optax.apply_updates(params, updates), state

    state = jax.eval_shape(tx.init, params)
    report = jaxscale.lowering_report(step, params, state, jax.ShapeDtypeStruct((), F32))
    assert not report.syncs_with_host, report
    assert report.data_conditionals == 0, report
    assert report.loops == report.counted_loops
    if name == "bfloat16 state" or cpu_backend.loops_over_bfloat16():
        assert report.counted_loops >= 1


def test_slices_divide_a_leafs_rows_and_an_accelerators_take_at_least_two():
    # 768 rows of 2304: one slice of 4M elements would hold them, so one iteration,
    # or three (the odd count, for FSDP's power-of-two device counts) when two at least
    assert _in_place.trip_count(768, 2304, 1 << 22) == 1
    assert _in_place.trip_count(768, 2304, 1 << 22, least=2) == 3
    assert _in_place.trip_count(1024, 768, 1 << 22, least=2) == 2
    # GPT-2's embedding: 50,257 = 29 x 1733 rows, 29 slices either way
    assert _in_place.trip_count(50257, 768, 1 << 22) == 29
    assert _in_place.trip_count(50257, 768, 1 << 22, least=2) == 29
    # a prime count of rows is not split into one row per iteration to make two
    assert _in_place.trip_count(1009, 768, 1 << 22, least=2) == 1
    # on a CPU's 2**16 elements: 32 rows a slice (no odd count divides 2,048)
    assert _in_place.trip_count(2048, 2048, 1 << 16) == 64
    assert _in_place.trip_count(2048, 2048, 1 << 16, least=2) == 64


def test_a_leaf_is_sliced_in_rows_of_its_leading_axes_holding_the_same_blocks():
    by_rows = functools.partial(_blockwise.by_leading_axes, longest=1 << 16)
    # a matrix: its rows, each 16 blocks of 256 (a sharded last axis stays one axis)
    rows = by_rows(_blockwise.block_layout((64, 4096), 256))
    assert (rows.rows, rows.row_length, rows.blocks_per_row) == (64, 4096, 16)
    assert rows.scale_shape == (64, 16)
    # one axis, or rows longer than a slice: a row per block, as stored
    for shape in ((4096,), (2, 1 << 18)):
        stored = _blockwise.block_layout(shape, 256)
        assert by_rows(stored) == stored
    # partial blocks are rows of the leading axes already
    partial = _blockwise.block_layout((64, 1000), 256, partial_blocks=True)
    assert by_rows(partial) == partial
    # read either way, the same blocks: the same codes and scales
    ramp = jnp.arange(1, 4097, dtype=F32)[None] / 4096  # (blocks of unlike magnitudes)
    x = jax.random.normal(jax.random.key(0), (64, 4096)) * ramp
    stored = _blockwise.block_layout((64, 4096), 256)
    for fmt in ("int8", "float8_e4m3fn", "int4"):
        f = _blockwise.format_of(fmt)
        layout = _blockwise.block_layout((64, 4096), f.block_size)
        one, many = layout, by_rows(layout)
        a = _blockwise.quantize_rows(_blockwise.rows_of(x, one), one, f, True)
        b = _blockwise.quantize_rows(_blockwise.rows_of(x, many), many, f, True)
        for p, q in zip(a, b, strict=True):
            np.testing.assert_array_equal(bytes_of(p), bytes_of(q))
    assert stored.rows == 1024  # (the stored layout itself is unchanged)


def test_a_gpu_loops_over_a_block_quantized_leaf_that_fits_one_slice():
    # Computed whole, the leaves' blocks' maxima do not wait on one another's
    # quantizations, and XLA's GPU backend computed many leaves' maxima first, holding
    # their float32 moments together (GPT-2 small's layout, 8-bit state, compiled for
    # an H100: 1.90 bytes per parameter of temporaries; in loops of two or more, 0.09)
    params = {"w": jax.ShapeDtypeStruct((768, 2304), F32), "b": jax.ShapeDtypeStruct((768,), F32)}
    tx = jaxscale.low_precision_state(adamw(), "int8", partial_blocks=True)
    state = jax.eval_shape(tx.init, params)
    report = jaxscale.lowering_report(lambda s, g, p: tx.update(g, s, p), state, params, params)
    assert report.loops == report.counted_loops == 1, report  # the kernel's; not the bias's
    assert not report.syncs_with_host, report


def test_a_gpu_slices_float8_state_as_it_is():
    # XLA's CPU backend widens a whole float8 array to slice it, so its loop carries the
    # codes as bytes; for a GPU the loop carries them as float8 (a view of an argument
    # as bytes is a copy of it wherever XLA does not make it a bitcast)
    params = {"w": jax.ShapeDtypeStruct((4096, 2048), F32)}
    tx = jaxscale.low_precision_state(adamw(), jnp.float8_e4m3fn)
    state = jax.eval_shape(tx.init, params)

    def step(params, state):
        updates, state = tx.update(jax.tree.map(jnp.sin, params), state, params)
        return jax.tree.map(jnp.add, params, updates), state

    def module(platform):
        exported = jax.export.export(jax.jit(step), platforms=[platform])(params, state)
        return exported.mlir_module()

    def step_body(module):  # (the arguments are viewed there, before any loop)
        return module.split("func.func private")[0]

    as_bytes = re.compile(r"bitcast_convert %arg\d+ : \(tensor<[0-9x]*xf8E4M3FN>\) -> .*xui8>")
    assert as_bytes.search(step_body(module("cpu")))
    cuda = module("cuda")
    float8_slice_written = re.compile(r"dynamic_update_slice .*\(tensor<[0-9x]*xf8E4M3FN>, ")
    assert "stablehlo.while" in cuda
    assert float8_slice_written.search(cuda)
    assert not as_bytes.search(step_body(cuda))


def test_each_float8_scale_is_divided_by_a_divisor_of_its_own():
    # torchao's scale amax / 448 is correctly rounded where XLA cannot rewrite the
    # division as a multiplication (a divisor selected on the numerator), and no two
    # leaves share the divisor: XLA's GPU backend fuses quantizations that share an
    # operand into one kernel, which then holds every leaf's float32 state at once
    # (measured for an H100: 5.55 bytes per parameter of temporaries at 10M/50, where
    # one leaf at a time holds 0.16; an optimization barrier, which XLA's GPU backend
    # removes before it fuses, did not keep them apart)
    def quantize_two(a, b):
        return [jaxscale.quantize_blockwise(x, jnp.float8_e4m3fn) for x in (a, b)]

    x = jax.ShapeDtypeStruct((512,), F32)
    main = jax.jit(quantize_two).lower(x, x).as_text().split("func.func private")[0]
    defined = dict(re.findall(r"(%[\w#]+) = (\S+)", main))
    divisors = re.findall(r"stablehlo\.divide %[\w#]+, (%[\w#]+)", main)
    assert len(divisors) == 4  # per leaf: the scale, and the values by their scales
    assert all(defined[d] == "call" for d in divisors), [defined[d] for d in divisors]
    assert len(set(divisors)) == 4
    assert "optimization_barrier" not in main
    values = np.float32(2.0) ** np.arange(-20, 20, dtype=np.float32) * np.float32(1.2345)
    scale = jaxscale.quantize_blockwise(jnp.asarray(np.resize(values, 256)), jnp.float8_e4m3fn)[1]
    amax = np.abs(values).max()
    np.testing.assert_array_equal(scale, np.float32(amax) / np.float32(448))


@pytest.mark.parametrize("conditional", ["MultiSteps", "apply_if_finite"])
def test_a_conditional_update_lowered_for_a_gpu_has_no_conditional_on_data(conditional):
    # around the state, a conditional update is both branches and a selection: the GPU
    # runs no branch chosen on the device's data (inside the state, optax's own cond)
    params = {"w": jax.ShapeDtypeStruct((4096, 2048), F32)}
    wrap = {
        "MultiSteps": lambda tx: optax.MultiSteps(tx, every_k_schedule=4),
        "apply_if_finite": lambda tx: optax.apply_if_finite(tx, 3),
    }[conditional]
    tx = jaxscale.low_precision_state(third_party.optimizer(wrap(adamw())), "int8")

    def step(params, state):
        grads = jax.tree.map(jnp.sin, params)
        updates, state = tx.update(grads, state, params)
        return jax.tree.map(jnp.add, params, updates), state

    state = jax.eval_shape(tx.init, params)
    report = jaxscale.lowering_report(step, params, state)
    assert not report.syncs_with_host, report
    assert report.data_conditionals == 0, report
    assert report.loops == report.counted_loops >= 1


def test_a_loss_scalers_unscaled_gradients_are_read_slice_by_slice(monkeypatch):
    # The unscaled gradients are recomputed in each slice from the scaled ones, not
    # written out for the loop (they were 4 bytes per parameter); the step stores what
    # the unscaled step stores, bit for bit.
    _, temporaries, _ = step_memory(
        jaxscale.grad_scaler(jaxscale.low_precision_state(adamw(), "int8")), layout(*TEN_M)
    )
    assert temporaries < 2.3
    params = {"w": jax.random.normal(jax.random.key(0), (64, 1024))}
    grads = {"w": jnp.sin(params["w"] * 3.0)}
    scaled = jax.tree.map(lambda g: g * 2.0**16, grads)  # exact: a power of two
    monkeypatch.setattr(_in_place, "CPU_SLICE", 4096)  # 16 iterations
    reference = jaxscale.low_precision_state(adamw(), "int8")
    expected_updates, expected = jax.jit(reference.update)(grads, reference.init(params), params)
    tx = jaxscale.grad_scaler(jaxscale.low_precision_state(adamw(), "int8"))
    updates, state = jax.jit(tx.update)(scaled, tx.init(params), params)
    np.testing.assert_array_equal(updates["w"], expected_updates["w"])
    for a, b in zip(jax.tree.leaves(state.inner_state), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(bytes_of(a), bytes_of(b))


def test_master_weights_casts_in_slices_what_it_casts_whole(monkeypatch):
    params = {"w": jax.random.normal(jax.random.key(0), (64, 1024)).astype(jnp.bfloat16)}
    grads = {"w": jnp.sin(params["w"] * 3)}

    def step():
        tx = jaxscale.master_weights(jaxscale.low_precision_state(adamw(), "int8"))
        return jax.jit(tx.update)(grads, tx.init(params), params)

    whole = step()
    monkeypatch.setattr(_in_place, "CPU_SLICE", 4096)  # 16 iterations
    sliced = step()
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(sliced), strict=True):
        np.testing.assert_array_equal(bytes_of(a), bytes_of(b))


@pytest.mark.parametrize("chained", [False, True])
def test_master_weights_hands_its_step_down_to_the_loop(chained, monkeypatch):
    # In a training step, master_weights' own step (master plus update, rounded) runs in
    # the 8-bit state's loop: each new bfloat16 parameter written into its gradient's
    # buffer, each new master into its own. An inner transform that changes the loop's
    # updates after it (chained) makes master_weights compute its step itself, from them.
    monkeypatch.setattr(_in_place, "CPU_SLICE", 4096)  # 16 iterations
    params = {
        "w": (jax.random.normal(jax.random.key(0), (64, 1024)) * 0.1).astype(BF16),
        "b": jnp.zeros((7,), F32),  # no master, and no block: as it is
    }
    handed = []
    original = _master_weights.FinishedStep.finished

    def finished(self, inner_updates):
        handed.append(original(self, inner_updates))
        return handed[-1]

    monkeypatch.setattr(_master_weights.FinishedStep, "finished", finished)

    def run(hand_down):
        state_tx = jaxscale.low_precision_state(adamw(), "int8")
        inner = optax.chain(state_tx, optax.scale(0.5)) if chained else state_tx
        tx = jaxscale.master_weights(inner)

        step = sine_training_step(tx)

        current, state = params, tx.init(params)
        with contextlib.ExitStack() as stack:
            if not hand_down:  # the step nobody may claim
                stack.enter_context(pytest.MonkeyPatch.context()).setattr(
                    _master_weights, "finishing", lambda step: contextlib.nullcontext()
                )
            for scale in [1.0, 2.0, 3.0]:
                current, state = step(current, state, jnp.float32(scale))
        return current, state

    alone = run(hand_down=False)
    assert handed == [False]
    handed.clear()
    down = run(hand_down=True)
    assert handed == [not chained]
    paths = jax.tree_util.tree_flatten_with_path(alone)[0]
    for (path, a), b in zip(paths, jax.tree.leaves(down), strict=True):
        where = jax.tree_util.keystr(path)
        assert a.dtype == b.dtype, where
        if not jnp.issubdtype(a.dtype, jnp.floating) or not a.ndim:  # codes, counts
            np.testing.assert_array_equal(bytes_of(a), bytes_of(b), err_msg=where)
        elif a.dtype == BF16:  # a last float32 bit apart in the master, rounded: rarely
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            np.testing.assert_allclose(a, b, rtol=2**-7, atol=1e-7, err_msg=where)
            assert np.mean(a != b) < 0.005, where
        else:  # the masters and the scales: float32's rounding apart at most
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=2e-9, err_msg=where)


def test_a_value_derived_from_a_derived_value_goes_back_to_the_first_source():
    source = jnp.linspace(0.0, 1.0, 64)
    shifted = source + 1 / 3
    cast = shifted.astype(jnp.bfloat16)  # not the same as shifting the cast
    assert elementwise_origin(cast) is None
    with (
        derived_elementwise({"a": shifted}, {"a": source}, lambda x: x + 1 / 3),
        derived_elementwise([cast], [shifted], lambda x: x.astype(jnp.bfloat16)),
    ):
        origin, function = elementwise_origin(cast)
        assert origin is source
        np.testing.assert_array_equal(function(source[8:40]), cast[8:40])
        assert elementwise_origin(shifted + 0) is None  # an equal value, not the same
    assert elementwise_origin(cast) is None  # known only inside the blocks


def test_compositions_keep_their_temporaries_bounded():
    params = layout(*TEN_M, BF16)
    measured = {
        name: step_memory(make(), params)[1]
        for name, make in {
            "master_weights": lambda: jaxscale.master_weights(adamw()),
            "master_weights(int8 state)": lambda: jaxscale.master_weights(
                jaxscale.low_precision_state(adamw(), "int8")
            ),
            "stochastic_rounding": lambda: jaxscale.stochastic_rounding(
                adamw(), key=jax.random.key(0)
            ),
            "stochastic_rounding(sgd)": lambda: jaxscale.stochastic_rounding(
                optax.sgd(1e-3), key=jax.random.key(0)
            ),
        }.items()
    }
    assert measured["master_weights"] < 0.01
    # the float32 casts of the gradients are made slice by slice in the loop (they were
    # written out whole: 6.03); XLA hands the loop its own copy of the bfloat16
    # gradients (2) beside the old 8-bit state (2)
    assert measured["master_weights(int8 state)"] < 4.1
    # The random words are hashed where the rounding reads them, never written (they
    # were 8 bytes per parameter); what is left is Adam's float32 update, which the
    # transform returns and Optax adds to the bfloat16 parameter after it.
    assert measured["stochastic_rounding"] < 4.1
    assert measured["stochastic_rounding(sgd)"] < 0.01


def test_a_conditional_update_is_read_as_both_branches_and_a_selection():
    # optax.MultiSteps and optax.apply_if_finite apply their inner update inside a
    # lax.cond; read as every branch computed and a select_n of their results (the
    # per-leaf finiteness flags apply_if_finite stacks into a vector computed once, as
    # the scalars are), the update is elementwise
    params = {"w": jnp.ones((256, 128)), "b": jnp.ones(128)}
    for inner in (optax.MultiSteps(adamw(), 2), optax.apply_if_finite(adamw(), 3)):
        fn, leaves = flat_update(third_party.optimizer(inner), params)
        program = ElementwiseProgram.read(fn, *leaves)
        assert program is not None
        assert program.branches


def test_a_conditional_update_keeps_its_saving_on_either_side():
    # Inside the conditional (low_precision_state wrapped in MultiSteps) or around it,
    # the 8-bit state's training step peaks far below float32 MultiSteps' (32 bytes per
    # parameter with JAX 0.10.2). Around it, the loop could not enter the conditional
    # and widened the whole state on every step: 36.04, above float32's;
    # optax.apply_if_finite around the state in the same way: 30.03, against 16.00 for
    # float32 Adam.
    params = layout(*TEN_M)

    def peak(tx):
        arguments, temporaries = in_step_memory(tx, params)
        return arguments + temporaries

    def accumulating(tx):
        return third_party.optimizer(optax.MultiSteps(tx, every_k_schedule=4))

    def int8(tx):
        return jaxscale.low_precision_state(tx, "int8")

    float32 = peak(accumulating(adamw()))  # (26.03 with JAX 0.12.1)
    inside = peak(accumulating(int8(adamw())))  # 0.64 of float32's (0.71 with JAX 0.12.1)
    around = peak(int8(accumulating(adamw())))  # 0.44 (0.55)
    assert inside < 0.75 * float32
    assert around < 0.6 * float32
    assert around < inside
    finite = third_party.optimizer(optax.apply_if_finite(adamw(), 3))
    assert peak(int8(finite)) < 0.75 * peak(adamw())


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn", "int4"])
def test_a_conditional_update_in_slices_keeps_an_unchanged_state_as_stored(fmt, monkeypatch):
    # In the steps a conditional leaves the state as it was (MultiSteps' accumulating
    # ones, apply_if_finite's skipped one), each row of a slice it left unchanged keeps
    # its stored codes and scales, bit for bit: quantized again, a block need not give
    # them back. The state around the conditional, updated in 4 to 96 slices, steps the
    # parameters as the state inside it does (to float32's last bit: XLA fuses the update
    # into other operations in the two programs).
    monkeypatch.setattr(_in_place, "CPU_SLICE", 1024)
    params = {
        "w": jax.random.normal(jax.random.key(0), (96, 256)) * 0.1,
        "v": jax.random.normal(jax.random.key(1), (8192,)),
    }
    gradients = [jax.tree.map(lambda p, i=i: jnp.sin(p * (i + 3.0)), params) for i in range(6)]
    gradients[3] = jax.tree.map(lambda g: g.at[0].set(jnp.nan), gradients[3])

    def run(tx):
        state, p, states = tx.init(params), params, []
        for grads in gradients:
            updates, state = jax.jit(tx.update)(grads, state, p)
            p = jax.tree.map(jnp.add, p, updates)
            states.append(state)
        return p, states

    def narrow(tx):
        return jaxscale.low_precision_state(tx, fmt)

    def statistics(state):  # the stored moments, as bytes
        inner = state.inner_state
        inner = inner.inner_opt_state if hasattr(inner, "inner_opt_state") else inner.inner_state
        return [bytes_of(leaf) for leaf in jax.tree.leaves(inner) if leaf.ndim]

    for wrap, unchanged in (
        (lambda tx: third_party.optimizer(optax.MultiSteps(tx, every_k_schedule=2)), [2, 4]),
        (lambda tx: third_party.optimizer(optax.apply_if_finite(tx, 3)), [3]),
    ):
        inside, _ = run(wrap(narrow(adamw())))
        around, states = run(narrow(wrap(adamw())))
        for step in unchanged:  # the state the step before left, byte for byte
            for a, b in zip(statistics(states[step - 1]), statistics(states[step]), strict=True):
                np.testing.assert_array_equal(a, b)
        for a, b in zip(jax.tree.leaves(inside), jax.tree.leaves(around), strict=True):
            np.testing.assert_allclose(a, b, rtol=2e-7, atol=1e-7)


# -- jit(init) ----------------------------------------------------------------------------------


def test_jit_init_quantizes_nothing_and_equals_eager_init():
    params = {f"p{i}": jnp.zeros((1024, 200)) for i in range(4)}  # 200K each, whole blocks
    for fmt in FORMATS:
        tx = jaxscale.low_precision_state(adamw(), fmt)
        module = jax.jit(tx.init).lower(params).as_text()
        assert not re.search(r"stablehlo\.(reduce|gather|divide)\b", module), fmt
        eager, jitted = tx.init(params), jax.jit(tx.init)(params)
        for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
            np.testing.assert_array_equal(bytes_of(a), bytes_of(b))


def test_zero_state_is_stored_as_torchaos_zeros_and_another_constant_quantized():
    params = {"w": jnp.zeros((64, 64))}
    state = jaxscale.low_precision_state(adam(), "int4").init(params).inner_state[0]
    assert not np.asarray(state.mu["w"].codes).any()
    assert not np.asarray(state.nu["w"].scale).any()
    # an optimizer whose state starts at a constant other than zero
    rms = third_party.optimizer(optax.scale_by_rms(initial_scale=0.5))
    stored = jaxscale.low_precision_state(rms, "int8").init(params).inner_state.nu["w"]
    codes, scale = jaxscale.quantize_blockwise(jnp.full((64, 64), 0.5), "int8", signed=False)
    np.testing.assert_array_equal(stored.codes, codes)
    np.testing.assert_array_equal(stored.scale, scale)


def test_jit_init_compiles_about_as_fast_as_optaxs():
    params = layout(10e6, 50)

    def seconds(tx):
        start = time.perf_counter()
        jax.jit(tx.init).lower(params).compile()
        return time.perf_counter() - start

    # the faster of three interleaved runs, the collector held off: a worker that has run
    # a thousand tests can pause for a second to collect, and two workers share two cores
    collecting = gc.isenabled()
    gc.disable()
    try:
        times = [
            (seconds(adamw()), seconds(jaxscale.low_precision_state(adamw(), "int8")))
            for _ in range(3)
        ]
    finally:
        if collecting:
            gc.enable()
    optax_time, ours = (min(column) for column in zip(*times, strict=True))
    # 27 s when XLA folded the quantization of the zero moments block by block
    assert ours < 10 * optax_time + 1.0


# -- every leaf, on request ---------------------------------------------------------------------


def test_partial_blocks_quantize_every_leaf_and_keep_torchaos_leaves():
    params = {
        "dense": jnp.ones((1000, 1000)) * 0.01,  # 1,000,000 = 3,906.25 blocks of 256
        "stem": jnp.ones((7, 7, 3, 64)) * 0.01,  # 9,408 = 36.75 blocks
        "aligned": jnp.ones((64, 512)) * 0.01,  # quantized by torchao's rule too
        "small": jnp.ones((100,)),  # under 4,096 elements: kept
    }
    grads = jax.tree.map(lambda p: jnp.cos(p * 100), params)
    default = jaxscale.low_precision_state(adam(), "int8")
    every = jaxscale.low_precision_state(adam(), "int8", partial_blocks=True)
    states = []
    for tx in (default, every):
        state = tx.init(params)
        _, state = jax.jit(tx.update)(grads, state, params)
        states.append(state.inner_state[0])
    torchao_rule, partial = states
    assert partial.mu["dense"].scale.shape == (1000, 4)  # each row: 3 blocks and one of 232
    assert partial.mu["stem"].scale.shape == (7, 6)  # rows of 7 x 3 x 64 = 1,344
    assert torchao_rule.mu["dense"].dtype == F32
    np.testing.assert_array_equal(partial.mu["aligned"].codes, torchao_rule.mu["aligned"].codes)
    np.testing.assert_array_equal(partial.nu["aligned"].scale, torchao_rule.nu["aligned"].scale)
    assert partial.mu["small"].dtype == F32
    # and the partial blocks hold their values
    wide = jaxscale.dequantize_blockwise(*partial.mu["dense"], "int8", signed=True, block_size=256)
    expected = (1 - 0.9) * grads["dense"]
    np.testing.assert_allclose(wide, expected, rtol=0.02, atol=1e-6)


# -- FSDP ---------------------------------------------------------------------------------------

# the result's shape (a tuple where XLA combined several), the collective
COLLECTIVE = re.compile(
    r"= (\([^)]*\)|\S+) "
    r"(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(-start)?\("
)


def fsdp_mesh(devices=8):
    return jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("fsdp",))


def sharded_like_parameters(mesh, tree):
    """Each leaf sharded along its first axis (a state's codes and scales follow their
    parameter's leading axes), scalars replicated."""
    return jax.tree.map(lambda leaf: NamedSharding(mesh, P("fsdp") if np.ndim(leaf) else P()), tree)


FSDP_PARAMS = {
    "a": (2048, 1024),
    "b": (4096,),
    "c": (512, 64),  # blocks span rows
    "d": (1024, 1000),  # blocks span rows, and the rows are not a power of two of blocks
}


def fsdp_step(tx, mesh, gradients_in_step=False, shapes=FSDP_PARAMS, sharded=None):
    """The jitted FSDP step, its abstract parameters and state. With
    ``gradients_in_step`` it takes a scalar and computes the gradients from it (a
    training step's gradients are its own values, which the update may overwrite).
    ``sharded(mesh, tree)``: each leaf's sharding (by default along its first axis)."""
    sharded = sharded or sharded_like_parameters
    params = {
        name: jax.ShapeDtypeStruct(shape, F32, sharding=sharded(mesh, np.empty(shape)))
        for name, shape in shapes.items()
    }
    state = jax.eval_shape(tx.init, params)
    shardings = sharded(mesh, state)
    state = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), state, shardings
    )

    def step(params, state, grads):
        if gradients_in_step:
            grads = jax.tree.map(lambda p: jnp.sin(p) * grads, params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    jitted = jax.jit(step, donate_argnums=(0, 1), out_shardings=(None, shardings))
    return jitted, params, state


@pytest.mark.parametrize(
    "make",
    [
        *[lambda f=f: jaxscale.low_precision_state(adamw(), f) for f in FORMATS],
        lambda: jaxscale.low_precision_state(adamw(), "int8", partial_blocks=True),
        lambda: jaxscale.grad_scaler(jaxscale.low_precision_state(adamw(), "int8")),
        # computed on whole arrays (not elementwise): what it leaves unchanged is decided
        # row by row, on each device
        lambda: jaxscale.low_precision_state(
            third_party.optimizer(optax.MultiSteps(adamw(), 2)), "int8"
        ),
    ],
    ids=[*FORMATS, "int8, partial blocks", "grad_scaler(int8)", "MultiSteps inside int8"],
)
@pytest.mark.parametrize("gradients", ["given", "computed in the step"])
def test_an_fsdp_step_communicates_nothing_but_the_finite_check(make, gradients, request):
    mesh = fsdp_mesh()
    in_step = gradients != "given"
    jitted, params, state = fsdp_step(make(), mesh, gradients_in_step=in_step)
    grads = jax.ShapeDtypeStruct((), F32) if in_step else params
    compiled = machine.compiled_to_inspect(jitted.lower(params, state, grads))
    collectives = COLLECTIVE.findall(compiled.as_text())
    if "grad_scaler" in request.node.callspec.id:
        # grad_scaler's one all-reduce of its finite check: booleans
        assert all(kind == "all-reduce" and "pred" in shape for shape, kind, _ in collectives)
        assert collectives
    else:
        assert collectives == []
    for leaf, sharding in zip(
        jax.tree.leaves(state), jax.tree.leaves(compiled.output_shardings[1]), strict=True
    ):
        assert not leaf.ndim or not sharding.is_fully_replicated


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("gradients", ["given", "computed in the step"])
def test_a_step_of_parameters_sharded_along_their_last_axis_communicates_nothing(fmt, gradients):
    # column-parallel layers and FSDP over another axis: a loop over rows of one block
    # each cut across the shards of the last axis, and every state array was gathered
    mesh = fsdp_mesh()
    tx = jaxscale.low_precision_state(adamw(), fmt)
    shapes = {"a": (64, 4096), "b": (256, 2048), "c": (8, 2, 4096)}

    def along_the_last_axis(mesh, tree):
        def last(leaf):
            rank = np.ndim(leaf)
            return NamedSharding(mesh, P(*[None] * (rank - 1), "fsdp") if rank else P())

        return jax.tree.map(last, tree)

    in_step = gradients != "given"
    jitted, params, state = fsdp_step(tx, mesh, in_step, shapes, along_the_last_axis)
    grads = jax.ShapeDtypeStruct((), F32) if in_step else params
    compiled = machine.compiled_to_inspect(jitted.lower(params, state, grads))
    assert COLLECTIVE.findall(compiled.as_text()) == []


STACK = (6, 256, 256)  # (layers, rows, columns): a scan over layers keeps its weights so
STACK_SHARDED = P(None, "fsdp", None)  # FSDP of the stack: each layer's rows


def stacked_fsdp_step(tx, dtype=F32, shape=STACK, spec=STACK_SHARDED):
    """A stacked weight sharded along its second axis (or a weight of ``shape`` sharded
    as ``spec``) and its state placed likewise (``jax.jit(tx.init)`` with those
    shardings: codes and moments as the weight, the scales replicated), and the jitted
    step a user writes: no ``out_shardings``, so that where the new state lands is the
    step's own doing."""
    mesh = fsdp_mesh()
    along = NamedSharding(mesh, spec)
    params = jax.ShapeDtypeStruct(shape, dtype, sharding=along)
    packed = (*shape[:-1], shape[-1] // 2)  # ("int4" codes)
    state = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(
            s.shape,
            s.dtype,
            sharding=along if s.shape in (shape, packed) else NamedSharding(mesh, P()),
        ),
        jax.eval_shape(tx.init, params),
    )

    def step(params, state):
        grads = jnp.sin(params.astype(F32) * 7).astype(params.dtype)
        updates, state = tx.update(grads, state, params)
        with third_party.standard_promotion():  # (optax's adamw on bfloat16)
            return optax.apply_updates(params, updates), state

    return jax.jit(step, donate_argnums=(0, 1)), params, state


STACKED_TRANSFORMS = {
    **{f: (lambda f=f: jaxscale.low_precision_state(adamw(), f), F32) for f in FORMATS},
    "stochastic_rounding": (
        lambda: jaxscale.stochastic_rounding(adamw(), key=jax.random.key(0)),
        jnp.bfloat16,
    ),
    "kahan_summation": (lambda: jaxscale.kahan_summation(adamw()), jnp.bfloat16),
    "master_weights(int8)": (
        lambda: jaxscale.master_weights(jaxscale.low_precision_state(adamw(), "int8")),
        jnp.bfloat16,
    ),
    "grad_scaler(int8)": (
        lambda: jaxscale.grad_scaler(jaxscale.low_precision_state(adamw(), "int8")),
        F32,
    ),
}


@pytest.mark.parametrize("name", list(STACKED_TRANSFORMS))
def test_a_stacked_weight_sharded_along_its_rows_keeps_its_state_sharded(name):
    # FSDP of a scan over layers: (layers, rows, columns) sharded along the rows. Read
    # as rows of both leading axes merged, the rows' shards were a minor part of one
    # axis: every transform gathered the weight and its state, whole, and returned the
    # state replicated on every device
    make, dtype = STACKED_TRANSFORMS[name]
    jitted, params, state = stacked_fsdp_step(make(), dtype)
    compiled = machine.compiled_to_inspect(jitted.lower(params, state))
    collectives = COLLECTIVE.findall(compiled.as_text())
    if name.startswith("grad_scaler"):  # its finite check, one flag
        assert [(kind, "pred" in shape) for shape, kind, _ in collectives] == [("all-reduce", True)]
    else:
        assert collectives == []
    for leaf, sharding in zip(
        jax.tree.leaves(state), jax.tree.leaves(compiled.output_shardings[1]), strict=True
    ):
        if leaf.shape == STACK:
            assert sharding.is_equivalent_to(NamedSharding(fsdp_mesh(), STACK_SHARDED), 3)


SHORT_ROWS = {  # rows shorter than a block (256), sharded along the row: 16 columns a device
    "a layer": ((256, 128), P(None, "fsdp")),
    "a stack": ((6, 256, 128), P(None, None, "fsdp")),
    # a convolution's kernel, its output channels sharded (ResNet-18's (3, 3, 32, 32))
    "a convolution": ((3, 3, 32, 32), P(None, None, None, "fsdp")),
}


SHORT_ROWS_TRANSFORMS = {
    **STACKED_TRANSFORMS,
    # computed on whole arrays (not elementwise): what it leaves unchanged is decided
    # row by row, a flag per block reduced across the devices that hold its columns
    "MultiSteps inside int8": (
        lambda: jaxscale.low_precision_state(
            third_party.optimizer(optax.MultiSteps(adamw(), 2)), "int8"
        ),
        F32,
    ),
}


@pytest.mark.parametrize("name", list(SHORT_ROWS_TRANSFORMS))
@pytest.mark.parametrize("weight", list(SHORT_ROWS))
def test_rows_shorter_than_a_block_sharded_along_them_keep_their_state_sharded(name, weight):
    # A layer's columns sharded (FSDP over a logical embedding axis of 128, as Flax's
    # lm1b model has it), each block of 256 two of its rows: read as runs of 256, the
    # shards were a minor part of one axis, and every transform gathered the weight and
    # its state (f32, u8, u16 of the weight's shape). Read as (blocks, 2, 128), each
    # device holds its columns of every block; the one collective left is the block
    # maxima's all-reduce, a float per block (and the loss scaler's finite check; none
    # for a state kept element by element). "int4"'s blocks of 128 are whole rows: its
    # state stayed sharded before too.
    make, dtype = SHORT_ROWS_TRANSFORMS[name]
    shape, spec = SHORT_ROWS[weight]
    jitted, params, state = stacked_fsdp_step(make(), dtype, shape, spec)
    compiled = machine.compiled_to_inspect(jitted.lower(params, state))
    collectives = COLLECTIVE.findall(compiled.as_text())
    assert {kind for _, kind, _ in collectives} <= {"all-reduce"}, collectives
    blocks = math.prod(shape) // (128 if name == "int4" else 256)
    for operands, _, _ in collectives:
        for operand in re.findall(r"(\w+)\[([\d,]*)\]", operands):
            kind, dims = operand
            elements = math.prod(int(d) for d in dims.split(",") if d)
            assert kind == "pred" or (kind == "f32" and elements <= blocks), collectives
    elementwise = name in ("bfloat16", "stochastic_rounding", "kahan_summation")
    assert bool(collectives) != elementwise, collectives
    packed = (*shape[:-1], shape[-1] // 2)
    for leaf, sharding in zip(
        jax.tree.leaves(state), jax.tree.leaves(compiled.output_shardings[1]), strict=True
    ):
        if leaf.shape in (shape, packed):
            assert sharding.is_equivalent_to(NamedSharding(fsdp_mesh(), spec), len(shape))


def assert_sharded_step_is_one_devices(tx, params, spec):
    """The step of :func:`stacked_fsdp_step` on ``params`` sharded as ``spec`` makes the
    state one device's ``tx.update`` makes, bit for bit."""
    jitted, abstract_params, abstract_state = stacked_fsdp_step(tx, F32, params.shape, spec)
    grads = jnp.sin(params * 7)
    alone = jax.jit(tx.update)(grads, tx.init(params), params)
    put = lambda tree, like: jax.tree.map(  # noqa: E731
        lambda x, s: jax.device_put(x, s.sharding), tree, like
    )
    _, new_state = jitted(put(params, abstract_params), put(tx.init(params), abstract_state))
    for a, b in zip(jax.tree.leaves(alone[1]), jax.tree.leaves(new_state), strict=True):
        np.testing.assert_array_equal(bytes_of(a), bytes_of(b))


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn"])
def test_a_step_of_rows_shorter_than_a_block_sharded_along_them_is_one_devices(fmt):
    shape, spec = SHORT_ROWS["a layer"]
    ramp = jnp.arange(1, shape[-1] + 1, dtype=F32)[None] / shape[-1]  # (unlike maxima)
    params = jax.random.normal(jax.random.key(2), shape) * ramp
    assert_sharded_step_is_one_devices(jaxscale.low_precision_state(adamw(), fmt), params, spec)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_sharded_stacked_weights_step_computes_what_one_device_does(fmt):
    params = jax.random.normal(jax.random.key(1), STACK) * 0.1
    tx = jaxscale.low_precision_state(adamw(), fmt)
    assert_sharded_step_is_one_devices(tx, params, STACK_SHARDED)


def test_an_fsdp_step_computes_what_one_device_does():
    mesh = fsdp_mesh()
    tx = jaxscale.low_precision_state(adamw(), "int8")
    jitted, abstract_params, abstract_state = fsdp_step(tx, mesh)
    key = jax.random.key(0)
    params = {
        name: jax.random.normal(jax.random.fold_in(key, i), shape) * 0.1
        for i, (name, shape) in enumerate(FSDP_PARAMS.items())
    }
    grads = jax.tree.map(lambda p: jnp.sin(p * 7), params)
    alone = jax.jit(tx.update)(grads, tx.init(params), params)
    put = lambda tree, like: jax.tree.map(  # noqa: E731
        lambda x, s: jax.device_put(x, s.sharding), tree, like
    )
    sharded_params, new_state = jitted(
        put(params, abstract_params),
        put(tx.init(params), abstract_state),
        put(grads, abstract_params),
    )
    for a, b in zip(jax.tree.leaves(alone[1]), jax.tree.leaves(new_state), strict=True):
        np.testing.assert_array_equal(bytes_of(a), bytes_of(b))
        assert len(b.sharding.device_set) == 8
    with third_party.standard_promotion():
        expected = optax.apply_updates(params, alone[0])
    # the parameters to float32's rounding (the sharded program fuses the update into its
    # addition differently: a last-bit difference where a parameter is near zero)
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(sharded_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)


def test_an_8_bit_state_saved_on_8_devices_restores_onto_4_bit_for_bit(tmp_path):
    import orbax.checkpoint as ocp

    tx = jaxscale.low_precision_state(adamw(), "int8")
    params = {name: jnp.full(shape, 0.1) for name, shape in FSDP_PARAMS.items()}
    grads = jax.tree.map(
        lambda p: jnp.sin(jnp.arange(p.size, dtype=F32).reshape(p.shape) * 1e-3), params
    )
    _, state = jax.jit(tx.update)(grads, tx.init(params), params)
    eight = jax.device_put(state, sharded_like_parameters(fsdp_mesh(8), state))
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "state", eight)
    checkpointer.wait_until_finished()
    four = sharded_like_parameters(fsdp_mesh(4), state)
    target = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, four
    )
    restored = checkpointer.restore(tmp_path / "state", target)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(bytes_of(a), bytes_of(b))
        assert len(b.sharding.device_set) == (4 if b.ndim else len(b.sharding.device_set))


# -- meshes with explicit axes (sharding in types, jax.make_mesh's default) --------------------

EXPLICIT_TRANSFORMS = {
    **{fmt: (F32, lambda fmt=fmt: jaxscale.low_precision_state(adamw(), fmt)) for fmt in FORMATS},
    "stochastic_rounding": (
        BF16,
        lambda: jaxscale.stochastic_rounding(adamw(), key=jax.random.key(0)),
    ),
    "kahan_summation": (BF16, lambda: jaxscale.kahan_summation(adamw())),
    "master_weights(int8)": (
        BF16,
        lambda: jaxscale.master_weights(jaxscale.low_precision_state(adamw(), "int8")),
    ),
    "grad_scaler(int8)": (
        F32,
        lambda: jaxscale.grad_scaler(jaxscale.low_precision_state(adamw(), "int8")),
    ),
}  # fmt: skip


REPLICATED = (3, 5)


def mesh_of(kind, devices=8):
    return machine.mesh((devices,), ("fsdp",), axis_types=(kind,))


def explicit_step_run(tx, kind, dtype, spec, in_step, steps=2, inspect=True):
    """Parameters sharded as ``spec`` where they are matrices (along their one axis
    otherwise) trained ``steps`` steps under ``jax.set_mesh`` on a mesh of ``kind`` axes:
    (params, state, the first step compiled for inspection, or ``None`` without
    ``inspect``: a compile of its own). Along rows, FSDP_PARAMS and a 64 x 4096
    leaf; along columns, leaves whose rows each device holds whole blocks of."""
    mesh = mesh_of(kind)
    if spec == P("fsdp"):
        shapes = {**FSDP_PARAMS, "e": (64, 4096)}
    else:
        shapes = {"b": (4096,), "e": (64, 4096), "f": (256, 2048)}
    key = jax.random.key(0)
    params = {
        name: (jax.random.normal(jax.random.fold_in(key, i), shape) * 0.1).astype(dtype)
        for i, (name, shape) in enumerate(shapes.items())
    }
    placed = {n: NamedSharding(mesh, spec if p.ndim == 2 else P("fsdp")) for n, p in params.items()}
    # and a small parameter replicated (its update must not take another's sharding)
    params["replicated"] = jnp.linspace(-1, 1, 15, dtype=dtype).reshape(REPLICATED)
    placed["replicated"] = NamedSharding(mesh, P())
    params = jax.device_put(params, placed)

    def step(params, state, given):
        if in_step:
            grads = jax.tree.map(lambda p: jnp.sin(p * given.astype(p.dtype)), params)
            # written out in their dtype, as a layer's are (XLA may keep a bfloat16 sine
            # in float32 where it fuses it into a conversion, in one program and not in
            # another: see sine_training_step)
            grads = jax.lax.optimization_barrier(grads)
        else:
            grads = given
        updates, state = tx.update(grads, state, params)
        with third_party.standard_promotion():
            return optax.apply_updates(params, updates), state

    with jax.set_mesh(mesh):
        state = jax.jit(tx.init)(params)
        jitted = jax.jit(step, donate_argnums=(0, 1))
        compiled = None
        for k in range(steps):
            scale = jnp.float32(3.0 + k)
            given = scale if in_step else jax.tree.map(functools.partial(cosine, scale), params)
            if inspect and compiled is None:
                compiled = machine.compiled_to_inspect(jitted.lower(params, state, given))
            params, state = jitted(params, state, given)
    return params, state, compiled


def cosine(scale, p):
    return jnp.cos(p * scale.astype(p.dtype))


def spec_names(array):
    """The mesh axis names of an array's sharding (its type's, traced), trailing
    unsharded axes dropped."""
    traced = isinstance(array, jax.core.Tracer)
    names = tuple((jax.typeof(array).sharding if traced else array.sharding).spec)
    while names and names[-1] is None:
        names = names[:-1]
    return names


def explicit_sweep():
    """Each transform with its gradients passed to the step, and int8's computed in it.
    The other transforms' steps with gradients computed in them (each compiled for two
    shardings on two meshes, 10 to 20 s on a 2-core machine) are the slow run's."""
    for name in EXPLICIT_TRANSFORMS:
        yield pytest.param(name, "given", id=f"{name}-given")
        marks = () if name == "int8" else (pytest.mark.slow,)
        computed = "computed in the step"
        yield pytest.param(name, computed, marks=marks, id=f"{name}-{computed}")


@pytest.mark.parametrize(("name", "gradients"), list(explicit_sweep()))
def test_a_step_on_explicit_mesh_axes_is_the_step_on_automatic_ones(name, gradients, monkeypatch):
    # On jax.make_mesh's default axes (sharding in types) the slice loop raised JAX's
    # sharding type errors: its reshapes, slices and recomputed pieces follow no type
    # rule. It now runs with the axes made automatic for its duration.
    loops_over_bfloat16(monkeypatch, True)  # (the writers' loop, on any JAX)
    dtype, make = EXPLICIT_TRANSFORMS[name]
    explicit, automatic = jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto
    in_step = gradients != "given"
    specs = [P("fsdp")] if not in_step else [P("fsdp"), P(None, "fsdp")]
    for spec in specs:
        params, state, compiled = explicit_step_run(make(), explicit, dtype, spec, in_step)
        expected = explicit_step_run(make(), automatic, dtype, spec, in_step, inspect=False)
        # bit for bit the step on automatic axes: parameters and state
        got_leaves = jax.tree.leaves((params, state))
        for a, b in zip(jax.tree.leaves(expected[:2]), got_leaves, strict=True):
            np.testing.assert_array_equal(bytes_of(a), bytes_of(b))
            if not np.ndim(b):
                continue  # (a count, the loss scale)
            # ... and sharded as it: each state leaf with its parameter
            assert spec_names(a) == spec_names(b)
            assert len(b.sharding.device_set) == 8
            assert b.sharding.is_fully_replicated == (b.shape == REPLICATED)
        collectives = COLLECTIVE.findall(compiled.as_text())
        if name.startswith("grad_scaler"):  # its finite check's one all-reduce, of booleans
            assert collectives
            assert all(kind == "all-reduce" for _, kind, _ in collectives)
        else:
            assert collectives == [], (spec, collectives)


@pytest.mark.parametrize("fmt", ["int8", "int4", "bfloat16"])
def test_init_on_explicit_mesh_axes_types_the_state_as_its_parameters(fmt):
    # a state made of constants (the zero moments' codes and scales) was typed
    # replicated, and a step then all-gathered every parameter to meet it
    mesh = mesh_of(jax.sharding.AxisType.Explicit)
    tx = jaxscale.low_precision_state(adamw(), fmt)
    shapes = {
        "rows": ((64, 4096), P("fsdp")),
        "columns": ((64, 4096), P(None, "fsdp")),
        "blocks of rows": ((512, 64), P("fsdp")),
        "few blocks": ((16, 512), P(None, "fsdp")),
    }
    params = {n: jax.device_put(jnp.ones(shape), NamedSharding(mesh, spec))
              for n, (shape, spec) in shapes.items()}  # fmt: skip
    with jax.set_mesh(mesh):
        jitted, eager = jax.jit(tx.init)(params), tx.init(params)

    def trimmed(leaf):  # its spec, trailing unsharded axes dropped
        return P(*spec_names(leaf))

    mu = jitted.inner_state[0].mu
    for got in (mu, eager.inner_state[0].mu):
        names = jax.tree.map(trimmed, got)
        if fmt == "bfloat16":
            assert names == {n: P(*spec) for n, (_, spec) in shapes.items()}
            continue
        # codes as the parameter (int4's last axis halved); scales (leading axes, then
        # the blocks) along the same axis, where their length divides among the devices
        quantized = jaxscale.optim.BlockQuantized
        assert names["rows"] == quantized(P("fsdp"), P("fsdp"))
        assert names["columns"] == quantized(P(None, "fsdp"), P(None, "fsdp"))
        assert names["blocks of rows"] == quantized(P("fsdp"), P("fsdp"))
        # rows of 512 in blocks of 256 (int4: 128): 2 (4) per row, which 8 devices do not
        # divide: the scales replicated
        assert names["few blocks"] == quantized(P(None, "fsdp"), P())
    for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves(eager), strict=True):
        np.testing.assert_array_equal(bytes_of(a), bytes_of(b))


@pytest.mark.parametrize("fmt", ["int8", "bfloat16"])
def test_updates_shaped_as_the_parameters_keep_their_sharding_on_explicit_axes(fmt):
    # optax.lookahead's updates are shaped as its parameters (fast and slow), not as its
    # gradients (fast): typed replicated, each update was gathered to every device
    def trained(kind):
        mesh = mesh_of(kind)
        lookahead = third_party.optimizer(optax.lookahead(optax.adam(1e-3), 2, 0.5))
        tx = jaxscale.low_precision_state(lookahead, fmt)
        weights = {"w": jax.random.normal(jax.random.key(0), (64, 4096)) * 0.1}
        params = optax.LookaheadParams.init_synced(
            jax.device_put(weights, NamedSharding(mesh, P("fsdp")))
        )
        with jax.set_mesh(mesh):

            @jax.jit
            def step(params, state, scale):
                grads = jax.tree.map(lambda p: jnp.sin(p * scale + 1.0), params.fast)
                updates, state = tx.update(grads, state, params)
                return optax.apply_updates(params, updates), state

            state = jax.jit(tx.init)(params)
            text = step.lower(params, state, jnp.float32(1)).compile().as_text()
            for k in range(3):
                params, state = step(params, state, jnp.float32(k + 1))
        return params, state, COLLECTIVE.findall(text)

    automatic = trained(jax.sharding.AxisType.Auto)
    explicit = trained(jax.sharding.AxisType.Explicit)
    for a, b in zip(jax.tree.leaves(automatic[:2]), jax.tree.leaves(explicit[:2]), strict=True):
        np.testing.assert_array_equal(bytes_of(a), bytes_of(b))
    assert explicit[2] == automatic[2] == []
    assert explicit[0].slow["w"].sharding.spec[0] == "fsdp"


def test_a_skipped_step_on_explicit_mesh_axes_keeps_the_state_bit_for_bit():
    mesh = mesh_of(jax.sharding.AxisType.Explicit)
    tx = jaxscale.grad_scaler(jaxscale.low_precision_state(adam(), "int8"))
    params = jax.device_put({"w": jnp.ones((64, 4096))}, NamedSharding(mesh, P("fsdp")))
    poison = jnp.where(jnp.arange(64)[:, None] == 3, jnp.inf, 1.0)
    with jax.set_mesh(mesh):
        update = jax.jit(tx.update)
        grads = jax.tree.map(lambda p: jnp.sin(p) * 0.5, params)
        _, state = update(grads, tx.init(params), params)
        updates, skipped = update(jax.tree.map(lambda g: g * poison, grads), state, params)
    before, after = jax.tree.leaves(state.inner_state), jax.tree.leaves(skipped.inner_state)
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(bytes_of(a), bytes_of(b))
    assert float(skipped.scaler.scale) == float(state.scaler.scale) / 2
    np.testing.assert_array_equal(bytes_of(updates["w"]), bytes_of(jnp.full((64, 4096), -0.0)))


def test_a_step_on_explicit_mesh_axes_costs_the_memory_of_one_on_automatic_ones(monkeypatch):
    # the masters a writer keeps are passed to its optimizer as the parameters too: each
    # retyped on its own, the loop carried both (4 bytes per parameter more)
    loops_over_bfloat16(monkeypatch, True)
    kinds = jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit
    temporaries = []
    for kind in kinds:
        mesh = mesh_of(kind)
        tx = jaxscale.master_weights(jaxscale.low_precision_state(adamw(), "int8"))
        placed = NamedSharding(mesh, P("fsdp"))
        params = {"w": jax.ShapeDtypeStruct((1024, 2048), BF16, sharding=placed)}

        def step(params, state, scale, tx=tx):
            grads = jax.tree.map(lambda p: jnp.sin(p * scale.astype(p.dtype)), params)
            updates, state = tx.update(grads, state, params)
            with third_party.standard_promotion():
                return optax.apply_updates(params, updates), state

        with jax.set_mesh(mesh):
            state = jax.eval_shape(tx.init, params)
            lowered = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, jnp.float32(1))
            memory = machine.compiled_to_inspect(lowered).memory_analysis()
        temporaries.append(memory.temp_size_in_bytes / (1024 * 2048 / 8))
    assert temporaries[1] == temporaries[0] < 5.0, temporaries


@pytest.mark.parametrize(
    "make",
    [
        lambda: jaxscale.stochastic_rounding(adamw(), key=jax.random.key(0)),
        lambda: jaxscale.kahan_summation(adamw()),
        lambda: jaxscale.master_weights(adamw()),
        lambda: jaxscale.master_weights(jaxscale.low_precision_state(adamw(), "int8")),
    ],
    ids=["stochastic_rounding", "kahan_summation", "master_weights", "master_weights(int8)"],
)
@pytest.mark.parametrize("gradients", ["given", "computed in the step"])
def test_the_parameter_writers_communicate_nothing_under_fsdp(make, gradients, monkeypatch):
    # computed in the step, the parameters are written in the loop over slices (made to
    # run on any JAX here), whose slices span every device's shard
    loops_over_bfloat16(monkeypatch, True)
    mesh = fsdp_mesh()
    tx = make()
    params = {
        name: jax.ShapeDtypeStruct(shape, BF16, sharding=NamedSharding(mesh, P("fsdp")))
        for name, shape in FSDP_PARAMS.items()
    }
    state = jax.eval_shape(tx.init, params)
    shardings = sharded_like_parameters(mesh, state)
    state = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), state, shardings
    )

    def step(params, state, grads):
        if gradients != "given":
            grads = jax.tree.map(jnp.sin, params)
        updates, state = tx.update(grads, state, params)
        with third_party.standard_promotion():
            return optax.apply_updates(params, updates), state

    jitted = jax.jit(step, donate_argnums=(0, 1), out_shardings=(None, shardings))
    compiled = machine.compiled_to_inspect(jitted.lower(params, state, params))
    assert COLLECTIVE.findall(compiled.as_text()) == []


@pytest.mark.parametrize("loops", [False, True])
def test_a_training_step_draws_the_same_bits_on_any_mesh(loops, monkeypatch):
    # stochastic rounding in a training step, on whole arrays and in the loop's slices
    loops_over_bfloat16(monkeypatch, loops)
    monkeypatch.setattr(_in_place, "CPU_SLICE", 1 << 14)
    tx = jaxscale.stochastic_rounding(adamw(), key=jax.random.key(0))
    params = {
        name: (jax.random.normal(jax.random.key(i), shape) * 0.1).astype(BF16)
        for i, (name, shape) in enumerate(FSDP_PARAMS.items())
    }

    @jax.jit
    def step(params, state):
        grads = jax.tree.map(lambda p: jnp.sin(p * 3), params)
        updates, state = tx.update(grads, state, params)
        with third_party.standard_promotion():
            return optax.apply_updates(params, updates), state

    alone = step(params, tx.init(params))
    mesh = fsdp_mesh()
    put = lambda tree: jax.device_put(tree, sharded_like_parameters(mesh, tree))  # noqa: E731
    sharded = step(put(params), put(tx.init(params)))
    for a, b in zip(jax.tree.leaves(alone), jax.tree.leaves(sharded), strict=True):
        np.testing.assert_array_equal(bytes_of(a), bytes_of(b))


def test_a_stacked_weights_draws_in_the_loop_are_those_of_its_rows_merged(monkeypatch):
    # each element's bits are hashed from its index in the leaf: in the loop's slices of
    # a stack, the index counts the layers before it too
    loops_over_bfloat16(monkeypatch, True)
    params = (jax.random.normal(jax.random.key(1), STACK) * 0.1).astype(BF16)
    steps = []
    for shape in (STACK, (STACK[0] * STACK[1], STACK[2])):  # a stack; its rows merged
        tx = jaxscale.stochastic_rounding(adamw(), key=jax.random.key(0))

        def step(params, state, tx=tx):
            grads = jnp.sin(params.astype(F32) * 7).astype(BF16)
            updates, state = tx.update(grads, state, params)
            with third_party.standard_promotion():
                return optax.apply_updates(params, updates)

        steps.append(jax.jit(step)(params.reshape(shape), tx.init(params.reshape(shape))))
    np.testing.assert_array_equal(bytes_of(steps[0]), bytes_of(steps[1]))


def test_stochastic_rounding_draws_the_same_bits_on_any_mesh():
    tx = jaxscale.stochastic_rounding(adamw(), key=jax.random.key(0))
    params = {
        name: (jax.random.normal(jax.random.key(i), shape) * 0.1).astype(BF16)
        for i, (name, shape) in enumerate(FSDP_PARAMS.items())
    }
    grads = jax.tree.map(lambda p: jnp.sin(p * 3), params)
    alone = jax.jit(tx.update)(grads, tx.init(params), params)
    mesh = fsdp_mesh()
    put = lambda tree: jax.device_put(tree, sharded_like_parameters(mesh, tree))  # noqa: E731
    sharded = jax.jit(tx.update)(put(grads), put(tx.init(params)), put(params))
    for a, b in zip(jax.tree.leaves(alone), jax.tree.leaves(sharded), strict=True):
        np.testing.assert_array_equal(bytes_of(a), bytes_of(b))


def test_float8_codes_decode_to_what_a_conversion_gives_bit_for_bit():
    # every one of the 256 codes (subnormals, both zeros, the NaNs), in integer arithmetic
    # that fuses into the step (a table lookup was a gather written out per slice)
    codes = np.arange(256, dtype=np.uint8).view(jnp.float8_e4m3fn)
    decoded = jax.jit(_blockwise._float8_to_float32)(jnp.asarray(codes))
    expected = codes.astype(np.float32)
    np.testing.assert_array_equal(np.asarray(decoded).view(np.uint32), expected.view(np.uint32))


def test_4_bit_codes_are_unpacked_where_they_are_read():
    # Two codes a byte, the first in the high nibble (torchao's layout); each unpacked
    # by a shift that depends on its position, so the unpacking fuses into what reads
    # it. (Stacking the two nibbles is a concatenation, which XLA's GPU backend wrote
    # out whole: 2 bytes per parameter of temporaries for GPT-2's embedding in a loop.)
    fmt = _blockwise.format_of("int4")
    pairs = np.array([[(high << 4) | low for high in range(16) for low in range(16)]], np.uint8)
    unpacked = np.asarray(jax.jit(lambda c: _blockwise._unpack(c, fmt))(pairs))
    expected = np.stack([pairs >> 4, pairs & 0xF], axis=-1).reshape(1, -1)
    np.testing.assert_array_equal(unpacked, expected)
    assert np.array_equal(np.asarray(_blockwise._pack(jnp.asarray(unpacked), fmt)), pairs)
    codes, scale = jaxscale.quantize_blockwise(jnp.linspace(-1, 1, 4096), "int4")
    decode = functools.partial(jaxscale.dequantize_blockwise, dtype="int4", signed=True)
    module = jax.jit(decode).lower(codes, scale)
    assert "concatenate" not in module.as_text()
