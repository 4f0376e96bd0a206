"""jaxscale.locate_nonfinite finds the first operation whose output became non-finite.

Each test plants one fault (or two, to check which comes first) and asserts the
whole description: primitive, forward or backward, the line of the test's source
marked ``# <- origin``, the loop iteration, the kind and the dtype.
"""

from __future__ import annotations

import inspect
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from support import third_party
from support.sharded_mlp import sharded_mlp

import jaxscale

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32


def line_of(fn, marker="# <- origin"):
    """``tests/diagnosis/test_locate_nonfinite.py:LINE`` (run from the repository root):
    the line of ``fn``'s source holding ``marker``."""
    lines, first = inspect.getsourcelines(fn)
    found = [first + i for i, text in enumerate(lines) if marker in text]
    assert len(found) == 1, found
    # the path as jaxscale shows a user's file: relative to the working directory
    return f"{os.path.relpath(__file__)}:{found[0]}"


def located(fn, *args, jit=True):
    wrapped = jaxscale.locate_nonfinite(fn)
    return (jax.jit(wrapped) if jit else wrapped)(*args)


def expect(report, phase, primitive, where, kind, dtype, iteration=None):
    text = f"{phase} {primitive} at {where}"
    if iteration is not None:
        text += f", iteration {iteration}"
    assert report.describe() == f"{text}: {kind} ({dtype})"
    assert bool(report.found)


W = jnp.asarray(np.random.default_rng(0).uniform(0.5, 1.0, (4, 4)), F32)
X = jnp.ones((2, 4), F32)


# -- forward faults ------------------------------------------------------------------------


def log_of_zero(w, x):
    h = x @ w - jnp.sum(x @ w, axis=-1, keepdims=True)
    return jnp.sum(jnp.log(h * 0.0))  # <- origin


def log_of_negative(w, x):
    return jnp.sum(jnp.log(-(x @ w)))  # <- origin


def exp_overflow(w, x):
    return jnp.sum(jnp.exp(100.0 * (x @ w)))  # <- origin


def division_by_zero(w, x):
    return jnp.sum((x @ w) / (x @ w - x @ w))  # <- origin


@pytest.mark.parametrize(
    ("fn", "primitive", "kind"),
    [
        (log_of_zero, "log", "inf"),
        (log_of_negative, "log", "nan"),
        (exp_overflow, "exp", "inf"),
        (division_by_zero, "div", "inf"),
    ],
)
def test_forward_faults(fn, primitive, kind):
    out, report = located(fn, W, X)
    expect(report, "forward", primitive, line_of(fn), kind, "float32")
    np.testing.assert_array_equal(out, fn(W, X))  # bitwise the function's own


def float16_activation(w, x):
    h = x @ w  # <- origin
    return jnp.sum(h)


def overflow_then_nan(x):
    # sixteen values of one shape, checked together: the first origin is still the first
    for _ in range(5):
        x = jnp.tanh(x) + 1.0
    x = jnp.exp(x * 200.0)  # <- origin
    for _ in range(5):
        x = jnp.sin(x) * 2.0  # sin(inf) is a NaN born later
    return jnp.sum(x)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_values_checked_together_report_the_first_origin_in_order(jit):
    _, report = located(overflow_then_nan, X, jit=jit)
    expect(report, "forward", "exp", line_of(overflow_then_nan), "inf", "float32")


def _reductions_in_program(length):
    def chain(x):
        for _ in range(length):
            x = jnp.tanh(x * 1.5 + 0.1)
        return x

    return jax.jit(jaxscale.locate_nonfinite(chain)).lower(X).as_text().count("stablehlo.reduce")


def test_values_of_one_shape_are_reduced_eight_at_a_time():
    # 24 more iterations are 72 more checked values of one shape (the product, the sum,
    # the tanh): 9 reductions more, not 72 (what XLA compiles)
    assert _reductions_in_program(48) - _reductions_in_program(24) == 72 // 8


def test_a_float16_activation_over_65504_under_autocast():
    _, report = located(jaxscale.autocast(float16_activation), W * 3e4, X)
    expect(report, "forward", "dot_general", line_of(float16_activation), "inf", "float16")


def test_autocast_outside_locate_finds_the_same_origin():
    # the search runs on the program autocast evaluates; its table was written while
    # the function was traced, so it names the dtype the function was written in
    _, report = jax.jit(jaxscale.autocast(jaxscale.locate_nonfinite(float16_activation)))(
        W * 3e4, X
    )
    expect(report, "forward", "dot_general", line_of(float16_activation), "inf", "float32")


def bfloat16_exp(x):
    return jnp.exp(x.astype(BF16) * 200.0)  # <- origin


def test_a_bfloat16_overflow():
    _, report = located(bfloat16_exp, jnp.ones(3, F32))
    expect(report, "forward", "exp", line_of(bfloat16_exp), "inf", "bfloat16")


def float16_sum(x):
    return x + x  # <- origin


def test_float16_arithmetic_overflow_without_autocast():
    _, report = located(float16_sum, jnp.full(3, 40000.0, F16))
    expect(report, "forward", "add", line_of(float16_sum), "inf", "float16")


def masked_softmax(q, mask):
    logits = jnp.where(mask, q @ q.T, -jnp.inf)  # an intended -inf: no origin
    return jax.nn.softmax(logits)  # <- origin


def test_a_fully_masked_softmax_row_and_not_its_minus_inf_mask():
    mask = jnp.array([[True, False], [False, False]])
    _, report = located(masked_softmax, jnp.ones((2, 2)), mask)
    expect(report, "forward", "sub", line_of(masked_softmax), "nan", "float32")


def where_in_a_library_jit(x):
    return jnp.where(x > 0, jnp.log(x), jnp.log(-x))  # <- origin


def test_an_operation_of_a_library_function_names_the_users_line():
    _, report = located(where_in_a_library_jit, jnp.array([1.0, 0.0]))
    expect(report, "forward", "log", line_of(where_in_a_library_jit), "inf", "float32")


class Recurrent(nnx.Module):
    """An LSTM from Flax's own layers: the cell's matmuls run inside nnx.RNN's scan,
    traced so deep in Flax that JAX keeps none of the user's frames with them."""

    def __init__(self, rngs):
        self.rnn = nnx.RNN(nnx.LSTMCell(4, 8, rngs=rngs))

    def __call__(self, x):
        return self.rnn(x)  # <- origin


def test_inside_a_library_loop_the_users_line_is_the_loops():
    model = Recurrent(nnx.Rngs(0))
    # float16's max is 65504: two infinities of opposite signs, a NaN in the cell's gates
    # that reaches the output (an infinity alone saturates the gates, and is masked)
    x = jnp.ones((2, 10, 4), F32).at[1, 6, 2].set(7e4).at[1, 6, 3].set(-7e4)

    def loss(model, x):
        return jnp.sum(jaxscale.autocast(model)(x).astype(F32))

    _, report = nnx.jit(jaxscale.locate_nonfinite(loss))(model, x)
    where = f"{line_of(Recurrent)} (in flax/nnx/nn/linear.py:"
    assert report.describe().startswith(f"forward convert_element_type at {where}")
    assert report.describe().endswith(", iteration 6: inf (float16)")


# -- arguments -----------------------------------------------------------------------------


def test_a_non_finite_argument_is_the_origin_with_its_path():
    params = {"w": W, "b": jnp.array([0.0, jnp.nan])}
    _, report = located(lambda p, x: jnp.sum(x @ p["w"]) + p["b"], params, X)
    assert report.describe() == "argument [0]['b']: nan (float32)"
    origin = report.origin()
    assert (origin.source, origin.path, origin.dtype) == ("argument", "[0]['b']", "float32")


def test_a_reference_argument_is_checked_as_the_call_finds_it():
    def accumulate(ref, w, x):
        ref[...] += x @ w
        return jnp.sum(jnp.log(ref[...] - ref[...]))  # <- origin

    ref = jax.new_ref(jnp.zeros((2, 4)).at[1, 1].set(jnp.nan))
    _, report = jaxscale.locate_nonfinite(accumulate)(ref, W, X)
    assert report.describe() == "argument [0]: nan (float32)"
    ref = jax.new_ref(jnp.zeros((2, 4)))
    out, report = jax.jit(jaxscale.locate_nonfinite(accumulate))(ref, W, X)
    assert report.describe() == f"forward log at {line_of(accumulate)}: inf (float32)"
    np.testing.assert_array_equal(ref[...], X @ W)  # written in place, once
    assert out == -jnp.inf
    # one the function closes over, as the call finds it
    stats = jax.new_ref(jnp.full((3,), jnp.nan))
    _, report = jax.jit(jaxscale.locate_nonfinite(lambda w: jnp.sum(w) + stats[0]))(W)
    assert report.describe() == "a value the function closes over, shape (3,): nan (float32)"


def loss_of_batch(w, x):
    return jnp.sum(jnp.tanh(x @ w) - jnp.mean(x @ w))


@pytest.mark.parametrize("jit", [False, True])
def test_a_non_finite_value_the_function_closes_over_is_the_origin(jit):
    # The batch captured by the lambda that jax.grad differentiates: its inf, not the
    # backward matmul's 0 * inf it turns into, is the origin.
    batch = X.at[1, 2].set(jnp.inf)

    def step(w, x):
        return jaxscale.locate_nonfinite(jax.grad(lambda w: loss_of_batch(w, x)))(w)

    grads, report = (jax.jit(step) if jit else step)(W, batch)
    assert report.describe() == "a value the function closes over, shape (2, 4): inf (float32)"
    origin = report.origin()
    assert (origin.source, origin.shape, origin.dtype) == ("closed-over", (2, 4), "float32")
    np.testing.assert_array_equal(grads, jax.grad(loss_of_batch)(W, batch))
    # a NaN, and a finite value: nothing closed over is reported
    _, report = step(W, X.at[0, 0].set(jnp.nan))
    assert report.describe().endswith("shape (2, 4): nan (float32)")
    _, report = step(W, X)
    assert not bool(report.found)


def test_an_nnx_module_parameter_is_named_by_its_attribute_path():
    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    model.kernel[...] = model.kernel[...].at[1, 1].set(jnp.inf)
    _, report = located(lambda m, x: m(x), model, X, jit=False)
    assert report.describe().startswith("argument [0]['kernel']")
    assert report.describe().endswith(": inf (float32)")


def test_a_module_closed_over_by_jax_jit():
    # read only, as a plain call may: its parameters are not written back
    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    model.kernel[...] = model.kernel[...].at[1, 1].set(jnp.inf)
    out, report = jax.jit(lambda x: jaxscale.locate_nonfinite(model)(x))(X)
    np.testing.assert_array_equal(out, model(X))
    assert report.describe().startswith("argument <fn>['kernel']")


# -- the backward pass ---------------------------------------------------------------------


def sqrt_at_zero(w, x):
    return jnp.sum(jnp.sqrt(x @ w))  # <- origin


def test_a_jvp_term_computed_only_for_the_gradient_is_backward():
    # sqrt(0) is 0 in the forward pass; its derivative 0.5 / sqrt(0) is inf
    (value, _), report = located(jax.value_and_grad(sqrt_at_zero), W, 0.0 * X)
    assert float(value) == 0.0
    expect(report, "backward", "div", line_of(sqrt_at_zero), "inf", "float32")


def scaled_float16_matmul(w, x):
    return jnp.sum(x @ w)  # <- origin


def test_a_loss_scale_overflowing_a_float16_matmul_gradient():
    # the forward pass is finite; the weight gradient x.T @ (scale * ones) is not
    def scaled_loss(w, x):
        return 1e4 * jaxscale.autocast(scaled_float16_matmul)(w, x).astype(F32)

    x = jnp.full((16, 4), 10.0, F32)
    (loss, _), report = located(jax.value_and_grad(scaled_loss), W, x)
    assert np.isfinite(loss)
    expect(report, "backward", "dot_general", line_of(scaled_float16_matmul), "inf", "float16")


def test_nnx_grad_of_a_module():
    class Model(nnx.Module):
        def __init__(self):
            self.linear = nnx.Linear(4, 4, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return jnp.sqrt(self.linear(x))  # <- origin

    model = Model()
    _, report = located(nnx.grad(lambda m, x: jnp.sum(m(x))), model, -10.0 * X, jit=False)
    expect(report, "forward", "sqrt", line_of(Model.__call__), "nan", "float32")


@jax.custom_vjp
def reciprocal_gradient(x):
    return x


def _reciprocal_fwd(x):
    return x, x


def _reciprocal_bwd(x, g):
    return (g / x,)  # inf where x is 0


reciprocal_gradient.defvjp(_reciprocal_fwd, _reciprocal_bwd)


def through_custom_vjp(x):
    return jnp.sum(reciprocal_gradient(x * 1.0))  # <- origin


def test_a_custom_vjp_backward_rule_names_the_line_calling_the_function():
    _, report = located(jax.grad(through_custom_vjp), jnp.array([1.0, 0.0]))
    expect(report, "backward", "div", line_of(through_custom_vjp), "inf", "float32")


@jax.custom_jvp
def safe_looking_log(x):
    return jnp.log(x)  # <- origin


@safe_looking_log.defjvp
def _safe_looking_log_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return safe_looking_log(x), t / x


def through_custom_jvp(x):
    return jnp.sum(safe_looking_log(x))


def test_inside_a_custom_jvp_function_forward():
    # the custom function's own line: its body is the user's code
    _, report = located(through_custom_jvp, jnp.array([1.0, -1.0]))
    expect(report, "forward", "log", line_of(safe_looking_log), "nan", "float32")


# -- loops, conditionals, checkpoints, nested jit, vmap -----------------------------------


def scanned(w, x):
    def layer(h, _):
        return h * w, None  # <- origin

    return lax.scan(layer, x, None, length=10)[0]


def fori(w, x):
    return lax.fori_loop(0, 10, lambda i, h: h * w, x)  # <- origin


def while_loop(w, x):
    def body(carry):
        step, h = carry
        return step + 1, h * w  # <- origin

    return lax.while_loop(lambda carry: carry[0] < 10, body, (0, x))[1]


@pytest.mark.parametrize("fn", [scanned, fori, while_loop])
def test_the_iteration_of_a_loop(fn):
    # 1e5 ** 8 overflows float32: the eighth multiplication, iteration 7
    _, report = located(fn, jnp.float32(1e5), jnp.float32(1.0))
    expect(report, "forward", "mul", line_of(fn), "inf", "float32", iteration=7)


def reversed_scan(w, x):
    def layer(h, _):
        return h * w, None  # <- origin

    return lax.scan(layer, x, None, length=10, reverse=True)[0]


def test_the_iteration_counts_iterations_run_not_the_index():
    _, report = located(reversed_scan, jnp.float32(1e5), jnp.float32(1.0))
    expect(report, "forward", "mul", line_of(reversed_scan), "inf", "float32", iteration=7)


def nested_loops(w, x):
    def inner(h, _):
        return h * w, None  # <- origin

    def outer(h, _):
        return lax.scan(inner, h, None, length=3)[0], None

    return lax.scan(outer, x, None, length=4)[0]


def test_nested_loops_report_the_innermost_iteration():
    # multiplications 1..12 run as (outer, inner) = (0,0) (0,1) (0,2) (1,0) (1,1) (1,2) (2,0) (2,1)
    _, report = located(nested_loops, jnp.float32(1e5), jnp.float32(1.0))
    expect(report, "forward", "mul", line_of(nested_loops), "inf", "float32", iteration=1)


def branches(x, which):
    return lax.switch(
        which,
        [
            lambda v: jnp.sin(v),
            lambda v: jnp.log(v - 10.0),  # <- origin
            lambda v: jnp.cos(v),
        ],
        x,
    )


def test_the_branch_taken_of_a_switch():
    _, report = located(branches, jnp.ones(3), 1)
    expect(report, "forward", "log", line_of(branches), "nan", "float32")
    _, report = located(branches, jnp.ones(3), 0)
    assert not bool(report.found)


def conditional(x):
    return lax.cond(jnp.sum(x) > 0, lambda v: 1.0 / (v - v), jnp.sin, x)  # <- origin


def test_the_branch_taken_of_a_cond():
    _, report = located(conditional, jnp.ones(3))
    expect(report, "forward", "div", line_of(conditional), "inf", "float32")


def checkpointed(w, x):
    @jax.checkpoint
    def block(h):
        return jnp.exp(h @ w * 100.0)  # <- origin

    return jnp.sum(block(x))


def test_inside_a_checkpoint_forward_and_with_its_gradient():
    _, report = located(checkpointed, W, X)
    expect(report, "forward", "exp", line_of(checkpointed), "inf", "float32")
    # the gradient's infinities are those of the exp the backward pass computes again;
    # the forward pass's is masked (the loss is not an output)
    _, report = located(jax.grad(checkpointed), W, X)
    expect(report, "backward", "exp", line_of(checkpointed), "inf", "float32")


@jax.jit
def users_own_jit(x):
    return jnp.log(x - 2.0)  # <- origin


def test_inside_the_users_own_jitted_function():
    _, report = located(lambda x: users_own_jit(x) * 2.0, jnp.ones(3))
    expect(report, "forward", "log", line_of(users_own_jit), "nan", "float32")


@jax.jit
def nested_overflow(x):
    return jnp.exp(x * 200.0)  # <- origin


def overflow_inside_then_after(x):
    y = jnp.tanh(x)
    return jnp.log(nested_overflow(y) - jnp.inf)  # a NaN born after the nested jit's inf


def nan_before_then_overflow_inside(x):
    y = jnp.log(x - 2.0)  # <- origin
    return nested_overflow(y + 3.0)


def test_checks_inside_nested_jits_keep_the_order_of_evaluation():
    # a nested jit's checks are settled with its caller's: the first origin is still the
    # first in evaluation order, on either side of the call
    _, report = located(overflow_inside_then_after, jnp.ones(3))
    expect(report, "forward", "exp", line_of(nested_overflow), "inf", "float32")
    _, report = located(nan_before_then_overflow_inside, jnp.ones(3))
    expect(report, "forward", "log", line_of(nan_before_then_overflow_inside), "nan", "float32")


def per_example(x):
    return jax.vmap(lambda row: jnp.log(row[0]))(x)  # <- origin


def test_vmapped_code():
    _, report = located(per_example, jnp.array([[1.0, 2.0], [0.0, 1.0]]))
    expect(report, "forward", "log", line_of(per_example), "inf", "float32")


def two_faults(x):
    a = jnp.log(x - x)  # <- origin
    b = jnp.exp(x * 1000.0)
    return a + b


def test_the_first_of_two_faults_in_evaluation_order():
    _, report = located(two_faults, jnp.ones(2))
    expect(report, "forward", "log", line_of(two_faults), "inf", "float32")


def float8_layer(w, x):
    y = x @ w  # <- origin
    return jnp.sum(y.astype(jnp.float32)) * 1e4


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_an_overflow_in_a_float8_matmul_is_named_as_the_matmul_not_its_output_cast(recipe):
    # the float8 product is float32; it overflows in its cast to float16
    fn = jaxscale.autocast(float8_layer, dtype=F16, float8=recipe)
    big, small = jnp.full((32, 32), 100.0), jnp.full((16, 32), 100.0)
    _, report = located(fn, big, small)
    expect(report, "forward", "float8 dot_general", line_of(float8_layer), "inf", "float16")
    # the backward matmul: a cotangent of 1e4 times 32 ones
    _, report = located(jax.grad(fn), jnp.ones((32, 32)), jnp.ones((16, 32)))
    expect(report, "backward", "float8 dot_general", line_of(float8_layer), "inf", "float16")


def test_a_float8_matmuls_checks_are_settled_together_not_per_nested_function():
    # A rowwise float8 matmul is made of dozens of small jitted functions; their checks
    # settle with the caller's (the first origin found in vector operations once), so the
    # located gradient holds a few dozen reductions, where one settling per nested
    # function held 369 (and compiled three times slower).
    fn = jax.grad(jaxscale.autocast(float8_layer, dtype=F16, float8="rowwise"))
    text = (
        jax.jit(jaxscale.locate_nonfinite(fn))
        .lower(jnp.ones((32, 32)), jnp.ones((16, 32)))
        .as_text()
    )
    assert text.count("stablehlo.reduce") <= 60
    assert text.count("func.func") <= 40  # each check in lax operations, no jnp function


def test_an_mx_matmul_overflows_in_its_own_dot_general():
    fn = jaxscale.autocast(float8_layer, dtype=F16, float8="mxfp8")
    _, report = located(fn, jnp.full((32, 32), 100.0), jnp.full((32, 32), 100.0))
    expect(report, "forward", "dot_general", line_of(float8_layer), "inf", "float16")


# -- nothing found, and what the report is --------------------------------------------------


def healthy(w, x):
    return jnp.tanh(x @ w), jnp.sum(jnp.exp(-(x @ w)))


def test_nothing_found_leaves_the_outputs_bitwise_and_says_so():
    out, report = located(healthy, W, X)
    expected = jax.jit(healthy)(W, X)
    for got, want in zip(out, expected, strict=True):
        np.testing.assert_array_equal(
            np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32)
        )
    assert not bool(report.found)
    assert report.describe() == "no inf or NaN reached the outputs of this call"
    assert report.origin() is None


def test_the_report_is_a_pytree_of_arrays_and_describe_refuses_to_run_traced():
    _, report = located(healthy, W, X)
    leaves = jax.tree.leaves(report)
    assert [leaf.dtype for leaf in leaves] == [jnp.bool_, jnp.int32, jnp.int32, jnp.int32]

    @jax.jit
    def inside(w, x):
        _, report = jaxscale.locate_nonfinite(healthy)(w, x)
        with pytest.raises(TypeError, match="return the report from the jitted function"):
            report.describe()
        return report

    assert not bool(inside(W, X).found)


def test_a_bad_argument_raises():
    with pytest.raises(TypeError, match="locate_nonfinite expects a callable, got int 3"):
        jaxscale.locate_nonfinite(3)


def test_the_lowered_step_has_no_callback_loop_or_conditional_on_data():
    def step(w, x):
        loss, grads = jax.value_and_grad(
            lambda w: jnp.sum(jnp.tanh(jaxscale.autocast(lambda a, b: b @ a)(w, x)).astype(F32))
        )(w)
        return loss, grads

    with third_party.standard_promotion():
        result = jaxscale.lowering_report(jaxscale.locate_nonfinite(step), W, X, platform="cuda")
    assert result.host_transfers == 0, result
    # (which origins reach the outputs: a loop of a trip count fixed when it is traced)
    assert result.loops == result.counted_loops, result
    assert result.data_conditionals == 0, result


def test_eager_and_jit_agree():
    eager = located(exp_overflow, W, X, jit=False)[1]
    jitted = located(exp_overflow, W, X)[1]
    assert eager.describe() == jitted.describe()


# -- the scaler keeps the origin of its latest overflow -------------------------------------


def rooted(w, x):
    return jnp.sum(jnp.sqrt(x @ w))  # <- origin


def test_grad_scaler_keeps_the_origin_of_the_latest_skipped_step():
    import optax

    tx = jaxscale.grad_scaler(optax.sgd(0.1), init_scale=8.0, record_overflow_origin=True)
    params = {"w": jnp.eye(2)}
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x):
        def scaled(p):
            return jaxscale.scale(rooted(p["w"], x), opt_state)

        grads, report = jaxscale.locate_nonfinite(jax.grad(scaled))(params)
        updates, opt_state = tx.update(grads, opt_state, params, nonfinite_report=report)
        return optax.apply_updates(params, updates), opt_state, report

    params, opt_state, report = step(params, opt_state, jnp.ones((1, 2)))
    latest = jaxscale.last_overflow_origin(opt_state, report)
    assert latest.describe() == "no inf or NaN reached the outputs of this call"
    params, opt_state, report = step(params, opt_state, -jnp.ones((1, 2)))
    assert bool(jaxscale.found_inf(opt_state))
    expected = f"forward sqrt at {line_of(rooted)}: nan (float32)"
    assert report.describe() == expected
    params, opt_state, report = step(params, opt_state, jnp.ones((1, 2)))  # finite again
    assert not bool(report.found)
    assert jaxscale.last_overflow_origin(opt_state, report).describe() == expected


def test_grad_scaler_without_the_opt_in_refuses_a_report_and_keeps_nothing():
    import optax

    tx = jaxscale.grad_scaler(optax.sgd(0.1))
    params = {"w": jnp.eye(2)}
    opt_state = tx.init(params)
    assert opt_state.overflow_origin is None
    _, report = jaxscale.locate_nonfinite(lambda p: p)(params)
    with pytest.raises(ValueError, match="record_overflow_origin=True"):
        tx.update(params, opt_state, params, nonfinite_report=report)
    with pytest.raises(ValueError, match="keeps no overflow origin"):
        jaxscale.last_overflow_origin(opt_state, report)


def test_the_gradscaler_facade_keeps_the_origin_of_the_latest_overflow():
    import optax

    model = nnx.Linear(2, 2, use_bias=False, rngs=nnx.Rngs(0))
    model.kernel[...] = jnp.eye(2)
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    scaler = jaxscale.GradScaler(init_scale=8.0, record_overflow_origin=True)

    @nnx.jit
    def step(model, optimizer, scaler, x):
        def scaled(model, x):
            return scaler.scale(rooted(model.kernel[...], x))

        grads, report = jaxscale.locate_nonfinite(nnx.grad(scaled))(model, x)
        scaler.step(optimizer, model, grads)
        scaler.update(nonfinite_report=report)

    with pytest.raises(ValueError, match="no nonfinite_report was given to update"):
        scaler.last_overflow_origin()
    step(model, optimizer, scaler, jnp.ones((1, 2)))
    assert (
        scaler.last_overflow_origin().describe() == "no inf or NaN reached the outputs of this call"
    )
    step(model, optimizer, scaler, -jnp.ones((1, 2)))
    step(model, optimizer, scaler, 2 * jnp.ones((1, 2)))
    assert scaler.skipped_steps() == 1
    expected = f"forward sqrt at {line_of(rooted)}: nan (float32)"
    assert scaler.last_overflow_origin().describe() == expected
    with pytest.raises(ValueError, match="record_overflow_origin=True"):
        jaxscale.GradScaler().last_overflow_origin()


# -- values the code masks ------------------------------------------------------------------


def masked_log(w, x):
    h = x @ w
    return jnp.sum(jnp.where(h > 0, jnp.log(h), 0.0))  # NaN where h < 0, discarded


def test_a_value_the_code_masks_is_no_origin():
    # jnp.where discards the log's NaNs: the outputs are finite, and nothing is reported
    # (it was "forward log: nan"), in the value and in its gradient
    x = X.at[0].multiply(-1.0)
    for fn in (masked_log, jax.value_and_grad(masked_log)):
        outs, report = located(fn, W, x)
        assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(outs))
        assert not bool(report.found)
        assert report.describe() == "no inf or NaN reached the outputs of this call"


def masked_then_overflow(w, x):
    h = x @ w
    safe = jnp.where(h > 0, jnp.log(h), 0.0)  # a NaN, masked
    return jnp.sum(jnp.exp(safe * 1e3))  # <- origin: the one that reaches the output


def test_a_masked_value_does_not_hide_a_later_origin():
    _, report = located(masked_then_overflow, W, X.at[0].set(-1.0))
    expect(report, "forward", "exp", line_of(masked_then_overflow), "inf", "float32")


def clipped_step_factor(w, x):
    # as an adaptive solver's step-size controller computes its next factor: the
    # reciprocal of an error estimate, infinite where the estimate is zero, clipped
    def step(i, carry):
        y, factor = carry
        error = jnp.where(i > 2, jnp.max(jnp.abs(y @ w)), 0.0)  # zero at first
        factor = jnp.minimum(10.0, 0.9 / jax.lax.stop_gradient(error))
        return y * 0.5, factor

    y, factor = jax.lax.fori_loop(0, 5, step, (x, jnp.float32(1.0)))
    return jnp.sum(y) * factor


def test_an_infinity_clipped_inside_a_loop_is_no_origin():
    # (a Diffrax solve's controller computes 1 / scaled_error this way)
    outs, report = located(clipped_step_factor, W, X)
    assert np.isfinite(outs)
    assert not bool(report.found)
    (_, grads), report = located(jax.value_and_grad(clipped_step_factor), W, X)
    assert np.isfinite(grads).all()
    assert not bool(report.found)


def overflow_before_a_loop(w, x):
    h = jnp.exp(x @ w * 100.0)  # <- origin: before the loop, reaches the output

    def step(i, y):
        return y + jnp.log(y - 2.0)  # a NaN born inside the loop too, where y is 1

    return jnp.sum(jax.lax.fori_loop(0, 3, step, h))


def test_an_origin_before_a_loop_comes_before_the_loops_own():
    _, report = located(overflow_before_a_loop, W, X.at[1].set(0.0))
    expect(report, "forward", "exp", line_of(overflow_before_a_loop), "inf", "float32")


def loop_then_mask(w, x):
    def step(i, y):
        return jnp.exp(y * 100.0)  # an infinity born inside, carried out of the loop

    y = jax.lax.fori_loop(0, 2, step, x @ w)
    return jnp.sum(jnp.where(jnp.isfinite(y), y, 0.0))  # and masked after it


def test_an_infinity_from_a_loop_masked_after_it_is_no_origin():
    outs, report = located(loop_then_mask, W, X)
    assert np.isfinite(outs)
    assert not bool(report.found)


def unread_log(x):
    _ = jnp.log(-x)  # a NaN nothing reads
    return x * 2.0


def test_a_value_nothing_reads_is_no_origin():
    outs, report = located(unread_log, X)
    assert np.isfinite(outs).all()
    assert not bool(report.found)


# -- sharded models ---------------------------------------------------------------------------


@pytest.mark.parametrize("axes", ["automatic", "explicit"])
@pytest.mark.parametrize("recipe", [None, "rowwise", "mxfp8"])
def test_a_model_sharded_over_a_mesh_is_located_in(axes, recipe):
    # Flax's sharding guide's two layers on a 2 x 4 mesh. Each value's check was a
    # bitwise-or reduction, which XLA's CPU collectives refuse where the value is
    # sharded (UNIMPLEMENTED at run time, automatic axes); on explicit axes a float8
    # matmul, computed with them made automatic, gave values the checks met typed on
    # another mesh. A planted infinity in the batch is the origin either way.
    kind = jax.sharding.AxisType.Auto if axes == "automatic" else jax.sharding.AxisType.Explicit
    with sharded_mlp(kind) as (model, x):

        def loss(model, x):
            return jnp.mean(model(x).astype(F32) ** 2)

        located_loss = jax.jit(
            jaxscale.locate_nonfinite(jaxscale.autocast(loss, dtype=BF16, float8=recipe))
        )
        value, report = located_loss(model, x)
        assert np.isfinite(float(value))
        assert not bool(report.found)
        planted = jnp.where(jnp.arange(256)[None, :] == 3, jnp.inf, 1.0)
        _, report = located_loss(model, x * planted)
        assert bool(report.found)
        assert report.describe() == "argument [1]: inf (float32)"
