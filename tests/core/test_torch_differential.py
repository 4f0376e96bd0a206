"""jaxscale's core against PyTorch's own kernels, on random inputs, bit for bit.

* 1,000 random update sequences (100 random rules x 10 sequences, 48 steps each)
  through ``torch._amp_update_scale_`` and :func:`jaxscale.update_scale`, with
  non-power-of-two factors, extreme factors, and scales reaching float32's limits;
* 200 random gradient trees (mixed float16/bfloat16/float32, injected inf/NaN)
  through ``torch._amp_foreach_non_finite_check_and_unscale_`` (with GradScaler's
  inverse scale) and :func:`jaxscale.unscale_and_check`.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from support import torch_reference

from jaxscale import init_scaler_state, unscale_and_check, update_scale

RULES = 100
SEQUENCES_PER_RULE = 10
STEPS = 48
TREES = 200


def random_rule(rng):
    growth = rng.choice(
        [
            2.0,
            float(rng.uniform(1.0001, 4.0)),
            float(np.exp(rng.uniform(np.log(1.000001), np.log(1e4)))),
            1.0 + float(rng.integers(1, 8)) * 2.0**-52,
        ],
        p=[0.2, 0.5, 0.2, 0.1],
    )
    backoff = rng.choice(
        [
            0.5,
            float(rng.uniform(0.05, 0.999)),
            float(np.exp(rng.uniform(np.log(1e-12), np.log(0.9)))),
            1.0 - float(rng.integers(1, 8)) * 2.0**-53,
        ],
        p=[0.2, 0.5, 0.2, 0.1],
    )
    interval = int(rng.choice([1, 1, 2, 2, 3, 5, 7, 2000]))
    return float(growth), float(backoff), interval


def random_init_scale(rng):
    kind = rng.integers(4)
    if kind == 0:
        return float(np.float32(np.finfo(np.float32).max / rng.uniform(1.0, 8.0)))
    if kind == 1:
        return float(rng.integers(1, 2**23) * 2.0**-149)  # a float32 subnormal
    return float(np.float32(np.exp(rng.uniform(np.log(1e-30), np.log(1e30)))))


def jax_trajectories(rules, init_scales, found_infs):
    """Every rule's sequences through :func:`jaxscale.update_scale`, in one program: a
    rule's factors and interval are constants of its program, and one compile of
    all of them costs less than one compile each."""

    def trajectories(init_scales, found_infs):
        out = []
        for (growth, backoff, interval), inits, flags in zip(
            rules, init_scales, found_infs, strict=True
        ):

            def one_sequence(init_scale, flags, growth=growth, backoff=backoff, interval=interval):
                state = init_scaler_state(1.0)._replace(scale=init_scale)

                def body(state, found_inf):
                    state = update_scale(
                        state,
                        found_inf,
                        growth_factor=growth,
                        backoff_factor=backoff,
                        growth_interval=interval,
                    )
                    return state, (state.scale, state.growth_tracker)

                return jax.lax.scan(body, state, flags)[1]

            out.append(jax.vmap(one_sequence)(inits, flags))
        return out

    return jax.jit(trajectories)(jnp.asarray(init_scales), jnp.asarray(found_infs))


@pytest.mark.randomized
def test_random_update_sequences_match_pytorch_bit_for_bit():
    rng = np.random.default_rng(2024)
    rules, init_scales, found_infs = [], [], []
    for _ in range(RULES):
        rules.append(random_rule(rng))
        init_scales.append([random_init_scale(rng) for _ in range(SEQUENCES_PER_RULE)])
        probabilities = rng.uniform(0.0, 0.8, SEQUENCES_PER_RULE)
        found_infs.append(rng.random((SEQUENCES_PER_RULE, STEPS)) < probabilities[:, None])
    init_scales = np.array(init_scales, np.float32)
    found_infs = np.array(found_infs)
    trajectories = jax_trajectories(rules, init_scales, found_infs)
    sequences = mismatches = growths = backoffs = 0
    rounding_differs_from_float32 = 0
    for r, (growth, backoff, interval) in enumerate(rules):
        scales, trackers = (np.asarray(a) for a in trajectories[r])
        for i in range(SEQUENCES_PER_RULE):
            expected_scales, expected_trackers = torch_reference.update_scale_trajectory(
                float(init_scales[r, i]), found_infs[r, i].astype(float), growth, backoff, interval
            )
            same = (scales[i].view(np.uint32) == expected_scales.view(np.uint32)).all()
            same &= (trackers[i] == expected_trackers).all()
            mismatches += int(not same)
            sequences += 1
            previous = np.concatenate([[init_scales[r, i]], expected_scales[:-1]])
            growths += int((expected_scales > previous).sum())
            backoffs += int((expected_scales < previous).sum())
            with np.errstate(over="ignore"):
                naive = np.where(
                    found_infs[r, i],
                    previous * np.float32(backoff),
                    previous * np.float32(growth),
                )
            changed = expected_scales != previous
            rounding_differs_from_float32 += int((changed & (naive != expected_scales)).sum())
    assert sequences == RULES * SEQUENCES_PER_RULE == 1000
    assert mismatches == 0
    # the sequences exercise what they claim to
    assert growths > 1000
    assert backoffs > 5000
    assert rounding_differs_from_float32 > 100


def random_tree(rng):
    dtypes = [np.float16, ml_dtypes.bfloat16, np.float32]
    shapes = [(), (7,), (3, 5), (64,), (2, 3, 4)]
    leaves = {}
    for j in range(int(rng.integers(1, 7))):
        dtype = dtypes[rng.integers(3)]
        shape = shapes[rng.integers(len(shapes))]
        if dtype is np.float16:
            magnitude = np.exp(rng.uniform(np.log(6e-8), np.log(65504.0), shape))
        else:  # keep unscaled float32 products clear of float32 subnormals (flushed by XLA)
            magnitude = np.exp(rng.uniform(np.log(2.0**-60), np.log(2.0**60), shape))
        values = (rng.choice([-1.0, 1.0], shape) * magnitude).astype(dtype)
        values = np.where(rng.random(shape) < 0.1, np.zeros(shape, dtype), values).astype(dtype)
        if rng.random() < 0.15 and values.size:
            flat = values.reshape(-1)
            flat[rng.integers(flat.size)] = rng.choice([np.inf, -np.inf, np.nan])
            values = flat.reshape(shape)
        leaves[f"leaf{j}"] = values
    return leaves


def assert_same_bits(got, expected):
    got, expected = np.asarray(got), np.asarray(expected)
    assert got.dtype == expected.dtype
    width = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[got.dtype.itemsize]
    same = got.view(width) == expected.view(width)
    same |= np.isnan(got.astype(np.float32)) & np.isnan(expected.astype(np.float32))
    assert same.all()


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_random_gradient_trees_match_pytorch_bit_for_bit(mode):
    rng = np.random.default_rng(17)
    fn = jax.jit(unscale_and_check) if mode == "jit" else unscale_and_check
    trees = TREES if mode == "eager" else 25
    found = 0
    for _ in range(trees):
        tree = random_tree(rng)
        scale = np.float32(np.exp(rng.uniform(np.log(2.0**-10), np.log(2.0**30))))
        unscaled, found_inf = fn({k: jnp.asarray(v) for k, v in tree.items()}, jnp.float32(scale))
        expected, expected_found = torch_reference.unscale(list(tree.values()), scale)
        assert bool(found_inf) == expected_found
        for key, want in zip(tree, expected, strict=True):
            assert_same_bits(unscaled[key], want)
        found += int(expected_found)
    # both outcomes are exercised
    assert 0 < found < trees
