"""update_scale: PyTorch's _amp_update_scale_ rule, and the opt-in extensions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxscale
from jaxscale import ScalerState, init_scaler_state, update_scale

F32_MAX = float(np.finfo(np.float32).max)


def run(found_infs, init_scale=1.0, mode="eager", **rule):
    """(scales, trackers, streaks) after each update, eagerly, under jit or under lax.scan."""
    state = init_scaler_state(init_scale)
    flags = jnp.asarray(np.array(found_infs, bool))
    if mode == "scan":

        def body(state, found_inf):
            state = update_scale(state, found_inf, **rule)
            return state, state

        _, history = jax.lax.scan(body, state, flags)
        return tuple(np.asarray(h) for h in history)
    step = (
        jax.jit(lambda s, f: update_scale(s, f, **rule))
        if mode == "jit"
        else (lambda s, f: update_scale(s, f, **rule))
    )
    history = []
    for found_inf in flags:
        state = step(state, found_inf)
        history.append(state)
    return tuple(
        np.array([np.asarray(getattr(s, field)) for s in history]) for field in ScalerState._fields
    )


MODES = ["eager", "jit", "scan"]


@pytest.mark.parametrize("mode", MODES)
def test_pytorch_unit_test_numbers(mode):
    # PyTorch's test_grad_scaling_update_scale: growth 2, backoff 0.25, interval 2, from 4.0.
    scales, trackers, *_ = run(
        [0, 0, 1], 4.0, mode, growth_factor=2.0, backoff_factor=0.25, growth_interval=2
    )
    assert trackers.tolist() == [1, 0, 0]
    assert scales.tolist() == [4.0, 8.0, 2.0]


@pytest.mark.parametrize("mode", MODES)
def test_non_power_of_two_factors_match_pytorch_bit_for_bit(mode, torch_reference):
    flags = [0, 0, 1, 0, 1, 1, 0]
    scales, *_ = run(flags, 1.0, mode, growth_factor=1.5, backoff_factor=0.3, growth_interval=1)
    assert float(scales[-1]) == 0.1366875022649765
    expected, _ = torch_reference.update_scale_trajectory(1.0, flags, 1.5, 0.3, 1)
    assert scales.view(np.uint32).tolist() == expected.view(np.uint32).tolist()


def test_growth_only_on_exact_equality_with_the_interval(torch_reference):
    # A tracker already past the interval (e.g. loaded from a checkpoint) never grows.
    state = init_scaler_state(8.0, growth_tracker=5)
    for expected_tracker in [6, 7, 8]:
        state = update_scale(state, False, growth_interval=3)
        assert int(state.growth_tracker) == expected_tracker
        assert float(state.scale) == 8.0
    scales, trackers = torch_reference.update_scale_trajectory(
        8.0, [0, 0, 0], 2.0, 0.5, 3, init_tracker=5
    )
    assert trackers.tolist() == [6, 7, 8]
    assert scales.tolist() == [8.0] * 3


def test_growth_to_inf_is_refused_but_the_tracker_still_resets(torch_reference):
    state = init_scaler_state(F32_MAX / 1.5)
    state = update_scale(state, False, growth_factor=2.0, growth_interval=1)
    assert float(state.scale) == float(np.float32(F32_MAX / 1.5))
    assert int(state.growth_tracker) == 0
    expected, trackers = torch_reference.update_scale_trajectory(F32_MAX / 1.5, [0], 2.0, 0.5, 1)
    assert float(state.scale) == float(expected[0])
    assert trackers.tolist() == [0]


def test_backoff_has_no_floor_and_reaches_zero_as_pytorch(torch_reference):
    flags = [1] * 170
    scales, trackers, *_ = run(flags, 2.0**16, "scan")
    expected, expected_trackers = torch_reference.update_scale_trajectory(
        2.0**16, flags, 2.0, 0.5, 2000
    )
    # the scale passes through float32 subnormals (kept exactly) down to 0.0
    assert 0.0 < expected[142] < np.finfo(np.float32).tiny
    assert scales.view(np.uint32).tolist() == expected.view(np.uint32).tolist()
    assert float(scales[-1]) == 0.0
    assert trackers.tolist() == expected_trackers.tolist()


def test_found_inf_may_be_a_float_count_as_in_pytorch():
    state = init_scaler_state(4.0)
    assert float(update_scale(state, jnp.float32(2.0)).scale) == 2.0
    assert float(update_scale(state, 0.0).scale) == 4.0
    with pytest.raises(ValueError, match=r"found_inf must be a scalar, got shape \(2,\)"):
        update_scale(state, jnp.zeros(2))


def test_output_dtypes_are_fixed():
    state = update_scale(init_scaler_state(), jnp.asarray(True))
    assert [x.dtype for x in state] == [jnp.float32, jnp.int32, jnp.int32, jnp.bool_, jnp.int32]
    assert all(x.shape == () for x in state)


@pytest.mark.parametrize("mode", MODES)
def test_min_scale_floors_backoff(mode):
    scales, *_ = run([1, 1, 1, 0], 8.0, mode, min_scale=3.0, growth_interval=1)
    assert scales.tolist() == [4.0, 3.0, 3.0, 6.0]


@pytest.mark.parametrize("mode", MODES)
def test_max_scale_caps_growth_and_still_resets_the_tracker(mode):
    scales, trackers, *_ = run([0, 0, 0, 0, 1], 4.0, mode, max_scale=10.0, growth_interval=2)
    assert scales.tolist() == [4.0, 8.0, 8.0, 10.0, 5.0]
    assert trackers.tolist() == [1, 0, 1, 0, 0]


@pytest.mark.parametrize("mode", MODES)
def test_hysteresis_backs_off_on_the_nth_consecutive_overflow_and_after(mode):
    flags = [1, 0, 1, 1, 1, 0, 0, 1]
    scales, trackers, streaks, *_ = run(flags, 64.0, mode, hysteresis=2, growth_interval=3)
    assert streaks.tolist() == [1, 0, 1, 1, 1, 0, 0, 1]
    assert scales.tolist() == [64.0, 64.0, 64.0, 32.0, 16.0, 16.0, 16.0, 16.0]
    assert trackers.tolist() == [0, 1, 0, 0, 0, 1, 2, 0]


def test_hysteresis_one_is_pytorch_and_keeps_the_streak_at_zero(torch_reference):
    flags = [1, 1, 0, 1]
    scales, trackers, streaks, *_ = run(flags, 64.0, "eager", hysteresis=1)
    expected, expected_trackers = torch_reference.update_scale_trajectory(
        64.0, flags, 2.0, 0.5, 2000
    )
    assert scales.tolist() == expected.tolist()
    assert trackers.tolist() == expected_trackers.tolist()
    assert streaks.tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize(("hysteresis", "kernels"), [(1, 3), (2, 4)])
def test_pytorch_hysteresis_compiles_no_kernel_for_the_streak(hysteresis, kernels):
    # The scale's update is compiled into every train step, and each scalar kernel
    # costs XLA's CPU backend milliseconds to compile. Under PyTorch's rule the
    # streak is always 0, written as a constant; a hysteresis of 2 updates it.
    rule = jaxscale.core.ScaleUpdateRule(hysteresis=hysteresis)
    state = init_scaler_state()
    text = jax.jit(rule.apply).lower(state, jnp.bool_(True)).compile().as_text()
    entry = text[text.index("ENTRY") :]
    assert entry.count(" fusion(") == kernels


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"growth_factor": 1.0}, ValueError, r"growth_factor must be > 1.0, got 1.0"),
        ({"growth_factor": float("inf")}, ValueError, r"growth_factor must be finite, got inf"),
        ({"growth_factor": "2"}, TypeError, r"growth_factor must be a real number, got str '2'"),
        (
            {"backoff_factor": 1.0},
            ValueError,
            r"backoff_factor must be in the open interval \(0, 1\), got 1.0",
        ),
        (
            {"backoff_factor": 0.0},
            ValueError,
            r"backoff_factor must be in the open interval \(0, 1\), got 0.0",
        ),
        ({"backoff_factor": float("nan")}, ValueError, r"backoff_factor must be finite, got nan"),
        (
            {"growth_interval": 0},
            ValueError,
            r"growth_interval must be an integer in \[1, 2\*\*31 - 1\], got 0",
        ),
        ({"growth_interval": 2.5}, TypeError, r"growth_interval must be an integer, got float 2.5"),
        (
            {"growth_interval": True},
            TypeError,
            r"growth_interval must be a real number, got bool True",
        ),
        (
            {"hysteresis": 0},
            ValueError,
            r"hysteresis must be an integer in \[1, 2\*\*31 - 1\], got 0",
        ),
        ({"min_scale": -1.0}, ValueError, r"min_scale must be positive and finite in float32"),
        ({"max_scale": 1e39}, ValueError, r"max_scale must be positive and finite in float32"),
        ({"min_scale": 4.0, "max_scale": 2.0}, ValueError, r"min_scale must be <= max_scale"),
        (
            {"growth_factor": np.array([2.0, 3.0])},
            TypeError,
            r"growth_factor must be a scalar number, got an array of shape \(2,\)",
        ),
    ],
)
def test_bad_hyperparameters_raise_naming_the_value(kwargs, error, message):
    with pytest.raises(error, match=message):
        update_scale(init_scaler_state(), False, **kwargs)


def test_numpy_and_concrete_array_hyperparameters_are_accepted():
    state = update_scale(
        init_scaler_state(2.0), False, growth_factor=np.float64(3.0), growth_interval=np.int64(1)
    )
    assert float(state.scale) == 6.0
    state = update_scale(
        init_scaler_state(2.0), False, growth_factor=jnp.float32(3.0), growth_interval=1
    )
    assert float(state.scale) == 6.0


def test_traced_hyperparameters_are_rejected():
    def step(factor):
        return update_scale(init_scaler_state(), False, growth_factor=factor).scale

    with pytest.raises(
        TypeError, match="growth_factor must be a concrete Python number, not a traced array"
    ):
        jax.jit(step)(2.0)


@pytest.mark.parametrize(
    ("init", "message"),
    [
        (0.0, r"init_scale must be positive and finite in float32 .* got 0.0"),
        (-1.0, r"init_scale must be positive and finite in float32 .* got -1.0"),
        (float("inf"), r"init_scale must be finite, got inf"),
        (float("nan"), r"init_scale must be finite, got nan"),
        (1e39, r"init_scale must be positive and finite in float32 .* got 1e\+39"),
        (1e-50, r"init_scale must be positive and finite in float32 .* got 1e-50"),
    ],
)
def test_bad_init_scale(init, message):
    with pytest.raises(ValueError, match=message):
        init_scaler_state(init)


def test_init_scale_rounds_to_float32_as_pytorch():
    state = init_scaler_state(0.1)
    assert float(state.scale) == float(np.float32(0.1))
    assert jaxscale.init_scaler_state(1e-40).scale.dtype == jnp.float32
    assert float(init_scaler_state(1e-40).scale) == float(np.float32(1e-40))  # a subnormal, kept
