"""What a GPU will run, checked without one: train steps lowered for CUDA, ROCm and TPU.

``jaxscale.lowering_report`` lowers a jitted step for another platform on this CPU
machine (``jax.export``); the StableHLO module is what the accelerator would compile.
The steps are those of ``examples/gpu_lowering.py``. On a GPU a ``while`` or a
conditional on data copies its predicate to the host every step, so the GPU
lowerings must have neither; no step may call back to the host; a step without
autocast converts no arrays between dtypes; and autocast's matmuls are float16.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support import paths, third_party

import jaxscale
from jaxscale.diagnosis._lowering import analyse_stablehlo

gpu_lowering = paths.example("gpu_lowering")
GPUS = ["cuda", "rocm"]
STEPS = list(gpu_lowering.STEPS)


def lowered(name, platform):
    with third_party.standard_promotion():  # the steps run optax's and flax's own code
        return gpu_lowering.lowered(name, platform)


@pytest.mark.parametrize("platform", [*GPUS, "tpu", "cpu"])
@pytest.mark.parametrize("name", STEPS)
def test_no_host_synchronisation_in_any_step(name, platform):
    result = lowered(name, platform)
    assert result.data_conditionals == 0, result
    assert result.host_transfers == 0, result
    assert result.loops == 0, result  # a select, not a loop, skips the step everywhere


@pytest.mark.parametrize("name", [n for n in STEPS if "autocast" not in n])
def test_loss_scaling_alone_converts_no_array(name):
    result = lowered(name, "cuda")
    assert result.array_converts == 0, result
    assert set(result.matmul_dtypes) == {"f32 x f32 -> f32"}


def test_the_main_example_runs_every_matmul_in_float16_on_the_gpu():
    result = lowered("main example: autocast + GradScaler", "cuda")
    assert result.matmul_dtypes == {"f16 x f16 -> f16": 39}  # 13 forward, 26 backward
    assert result.array_converts > 0  # the casts autocast inserted
    # the biases' gradients (and every other sum) accumulate in float32, as PyTorch's do
    assert set(result.sum_dtypes) == {"f32"}, result.sum_dtypes


def test_float8_runs_every_linear_layer_of_the_main_example_in_float8_on_the_gpu():
    # 9 linear layers (4 per block, 2 blocks, the output head): each runs its forward
    # matmul and both backward matmuls in float8; attention's batched einsums stay bfloat16
    tensorwise = lowered("main example: autocast float8 tensorwise", "cuda")
    assert tensorwise.matmul_dtypes == {
        "f8E4M3FN x f8E4M3FN -> f32": 9,  # forward: input and weight e4m3
        "f8E5M2 x f8E4M3FN -> f32": 9,  # input gradient: output gradient e5m2, weight e4m3
        "f8E4M3FN x f8E5M2 -> f32": 9,  # weight gradient: input e4m3, output gradient e5m2
        "bf16 x bf16 -> bf16": 12,
    }
    rowwise = lowered("main example: autocast float8 rowwise", "cuda")
    assert rowwise.matmul_dtypes == {"f8E4M3FN x f8E4M3FN -> f32": 27, "bf16 x bf16 -> bf16": 12}


# -- the analysis can fail: each thing it looks for is found when it is there ----------------


def lower(fn, *args, platform="cuda"):
    return jaxscale.lowering_report(fn, *args, platform=platform)


def test_a_conditional_on_data_is_found():
    result = lower(lambda x: jax.lax.cond(x.sum() > 0, jnp.sin, jnp.cos, x), jnp.ones(3))
    assert result.data_conditionals == 1


def test_a_loop_is_found():
    result = lower(lambda x: jax.lax.while_loop(lambda c: c.sum() < 10, lambda c: c * 2, x),
                   jnp.ones(3))  # fmt: skip
    assert (result.loops, result.counted_loops, result.syncs_with_host) == (1, 0, True)


@pytest.mark.parametrize(
    "loop",
    [
        lambda x: jax.lax.fori_loop(0, 5, lambda i, c: c.at[i].set(c[i] * 2), x),
        lambda x: jax.lax.scan(lambda c, y: (c + y, c), x[0], x)[0],
        lambda x: jax.lax.fori_loop(2, 7, lambda i, c: c * i, x),
    ],
    ids=["fori_loop", "scan", "fori_loop from 2"],
)
def test_a_loop_of_fixed_trip_count_is_counted_and_does_not_sync(loop):
    # XLA's GPU runtime runs a while loop whose trip count it knows without reading the
    # predicate back (WhileThunk with a known trip count)
    result = lower(loop, jnp.ones(8))
    assert (result.loops, result.counted_loops, result.syncs_with_host) == (1, 1, False)


def test_a_loop_bounded_by_data_is_not_counted():
    result = lower(lambda x, n: jax.lax.fori_loop(0, n, lambda i, c: c * 2, x), jnp.ones(3), 4)
    assert (result.loops, result.counted_loops, result.syncs_with_host) == (1, 0, True)


def test_a_host_callback_is_found():
    def fn(x):
        return jax.pure_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    # jax.export refuses host callbacks outright ("serialization of host_callbacks is not
    # yet implemented"), so an exported step cannot hold one; lowered for this CPU, found
    module = jax.jit(fn).lower(jnp.ones(3)).as_text()
    assert analyse_stablehlo(module).host_transfers == 1


def test_array_converts_and_matmul_dtypes_are_counted():
    result = lower(lambda a: a.astype(jnp.float16) @ a.astype(jnp.float16), jnp.ones((4, 4)))
    assert result.array_converts == 2  # one per operand (XLA merges them later)
    assert result.converted_elements == 32
    assert result.matmul_dtypes == {"f16 x f16 -> f16": 1}


def test_sums_are_counted_by_the_dtype_they_accumulate_in():
    def sums(x):
        half = x.astype(jnp.float16)
        return (
            jax.lax.reduce(half, np.float16(0), jax.lax.add, (0,)),  # float16, 4 terms each
            jnp.sum(x, axis=1),  # float32
            jax.lax.reduce(half[:1], np.float16(0), jax.lax.add, (0,)),  # one term: not a sum
            jnp.max(x),  # not a sum
        )

    assert lower(sums, jnp.ones((4, 3))).sum_dtypes == {"f16": 1, "f32": 1}


def test_constant_conditionals_are_not_counted_as_data():
    result = lower(lambda x: jax.lax.platform_dependent(x, cuda=jnp.sin, default=jnp.cos),
                   jnp.ones(3))  # fmt: skip
    assert result.data_conditionals == 0


def test_lowering_report_takes_a_jitted_function_and_shapes():
    step = jax.jit(lambda a: a.astype(jnp.float16) @ a.astype(jnp.float16))
    report = jaxscale.lowering_report(step, jax.ShapeDtypeStruct((4, 4), jnp.float32))
    assert report.matmul_dtypes == {"f16 x f16 -> f16": 1}
    assert not report.syncs_with_host


def test_lowering_report_reads_a_step_with_custom_calls_jax_does_not_keep_stable():
    # jax.export refuses to serialise a foreign function or a fused kernel that JAX does
    # not promise to keep stable; the report only reads the module, so it allows them
    def step(w, x):
        kernel = jax.ffi.ffi_call("my$kernel", jax.ShapeDtypeStruct(x.shape, x.dtype))
        return jaxscale.autocast(lambda w, x: jnp.tanh(kernel(x) @ w) @ w)(w, x)

    with pytest.raises(ValueError, match="custom calls whose targets"):
        jax.export.export(jax.jit(step), platforms=["cuda"])(jnp.ones((4, 4)), jnp.ones((2, 4)))
    report = jaxscale.lowering_report(step, jnp.ones((4, 4)), jnp.ones((2, 4)))
    assert report.matmul_dtypes == {"f16 x f16 -> f16": 2}
    assert not report.syncs_with_host


@pytest.mark.parametrize(
    ("fn", "platform", "error", "message"),
    [
        (3, "cuda", TypeError, "lowering_report expects a callable, got int 3"),
        (jnp.sin, "gpu", ValueError, "platform must be one of cuda, rocm, tpu, cpu; got 'gpu'"),
    ],
)
def test_lowering_report_names_a_bad_argument(fn, platform, error, message):
    with pytest.raises(error, match=re.escape(message)):
        jaxscale.lowering_report(fn, jnp.ones(3), platform=platform)


@pytest.mark.parametrize("stage", ["lower", "compile"])
def test_lowering_report_asks_for_the_function_when_given_it_lowered(stage):
    # train_step.lower(state) is the natural first try; it was lowered for this machine
    step = jax.jit(lambda a: a @ a).lower(jnp.ones((2, 2)))
    given = step if stage == "lower" else step.compile()
    kind = type(given).__name__
    message = (
        f"lowering_report expects a callable, got a {kind}, which is already lowered for one "
        "platform: pass the function and its arguments, "
        "lowering_report(step, *args, platform='cuda')"
    )
    with pytest.raises(TypeError, match=re.escape(message)):
        jaxscale.lowering_report(given)


def test_lowering_report_refuses_a_step_that_returns_nothing():
    # An nnx.jit step updates its objects in place and returns nothing: lowered as a
    # function, all of it is dead code. Reporting an empty program as clean would mislead.
    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    scaler = jaxscale.GradScaler()

    @nnx.jit
    def train_step(model, optimizer, scaler, x):
        grads = nnx.grad(lambda m: scaler.scale(jnp.sum(m(x) ** 2)))(model)
        scaler.step(optimizer, model, grads)
        scaler.update()

    refused = pytest.raises(ValueError, match="train_step returns no arrays, so everything it")
    with refused, third_party.standard_promotion():  # optax's and flax's own code
        jaxscale.lowering_report(train_step, model, optimizer, scaler, jnp.ones((3, 4)))


def test_lowering_report_keeps_a_jitted_functions_static_arguments():
    step = jax.jit(lambda x, n: x * n, static_argnums=1)
    assert jaxscale.lowering_report(step, jnp.ones(3), 2).loops == 0
