"""Scales below 1 and a scale of 0, side by side with torch.amp.GradScaler.

Below 1, unscaling multiplies: a large finite scaled gradient can overflow only
after unscaling, and a scale of 0 turns zero gradients into NaN (0 * inf). PyTorch
decides ``found_inf`` on the *scaled* gradients, so it steps on both; a scaler
that checked the unscaled values would skip instead and back off. For each
adapter (nnx.Optimizer, Optax triple, TrainState), through ``unscale_`` ->
``step`` -> ``update`` and through ``step`` -> ``update``, scale, tracker, skip
decision and parameters must equal PyTorch's.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from support import third_party
from support import torch_twins as tw
from support.facade_drivers import DRIVERS, KEYS, WIDTH, scaled_grads

import jaxscale


def run_side_by_side(driver_kind, init_scale, backoff_factor, plan, unscale_first):
    """``plan``: per iteration None (plain), ("set", key, value) or ("scale-to-zero",)."""
    torch_model = tw.torch_model(3, width=WIDTH)
    torch_opt = torch.optim.SGD(torch_model.parameters(), lr=0.05)
    weights = dict(zip(KEYS, [jnp.asarray(p) for p in tw.torch_params(torch_model)], strict=True))
    driver = DRIVERS[driver_kind](weights, "sgd", 0.05)
    hyper = {"init_scale": init_scale, "backoff_factor": backoff_factor, "growth_interval": 1000}
    torch_scaler = torch.amp.GradScaler("cpu", **hyper)
    scaler = jaxscale.GradScaler(**hyper)
    batches = tw.data(5, batches=len(plan), width=WIDTH)
    history = []
    for (x, y), event in zip(batches, plan, strict=True):
        torch_opt.zero_grad()
        loss = torch.nn.functional.mse_loss(torch_model(torch.from_numpy(x)), torch.from_numpy(y))
        torch_scaler.scale(loss).backward()
        grads = scaled_grads(
            driver.params, scaler.scale(jnp.float32(1.0)), jnp.asarray(x), jnp.asarray(y), 1
        )
        if event is not None and event[0] == "set":
            _, key, value = event
            layer, part = key.split(".")
            getattr(torch_model[int(layer)], part).grad.data.fill_(value)
            grads = {**grads, key: jnp.full_like(grads[key], value)}
        grads = driver.from_dict(grads)
        if unscale_first:
            torch_scaler.unscale_(torch_opt)
            grads = scaler.unscale_(driver.key(), grads)
        torch_scaler.step(torch_opt)
        driver.step(scaler, grads)
        torch_scaler.update()
        scaler.update()

        assert (
            np.float32(scaler.get_scale()).tobytes()
            == np.float32(torch_scaler.get_scale()).tobytes()
        ), (event, scaler.get_scale(), torch_scaler.get_scale())
        assert scaler._get_growth_tracker() == torch_scaler._get_growth_tracker()
        ours = driver.to_list(driver.from_dict(driver.params))
        for a, b in zip(ours, tw.torch_params(torch_model), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        history.append((scaler.get_scale(), scaler.found_inf(), ours))
    return history


@pytest.mark.parametrize("unscale_first", [False, True], ids=["step", "unscale_+step"])
@pytest.mark.parametrize("driver_kind", ["nnx", "optax", "trainstate"])
def test_a_large_finite_gradient_below_scale_one_is_stepped_as_pytorch(driver_kind, unscale_first):
    # scale 0.5: 3e38 is finite scaled and overflows to inf when unscaled (x 2)
    plan = [None, ("set", "1.weight", 3e38), None]
    with third_party.standard_promotion():
        history = run_side_by_side(driver_kind, 0.5, 0.5, plan, unscale_first)
    # the 3e38 step is taken (nothing found on the scaled values, no backoff); the inf it
    # puts into the weights makes the next gradients non-finite, which is then skipped
    assert [h[0] for h in history] == [0.5, 0.5, 0.25]
    assert [h[1] for h in history] == [False, False, True]
    assert np.isinf(history[1][2][2]).any()  # the overflow reached the weights, as in PyTorch


@pytest.mark.parametrize("unscale_first", [False, True], ids=["step", "unscale_+step"])
@pytest.mark.parametrize("driver_kind", ["nnx", "optax", "trainstate"])
def test_a_scale_backed_off_to_zero_turns_zero_gradients_into_nan_as_pytorch(
    driver_kind, unscale_first
):
    # from 1e-44 (a subnormal), two overflows with backoff 0.1 reach exactly 0.0
    plan = [("set", "0.bias", np.inf), ("set", "0.bias", np.inf), None]
    with third_party.standard_promotion():
        history = run_side_by_side(driver_kind, 1e-44, 0.1, plan, unscale_first)
    assert history[1][0] == 0.0
    assert [h[1] for h in history] == [True, True, False]  # the zero step is not skipped
    assert np.isnan(history[2][2][0]).all()  # 0 * (1 / 0): NaN everywhere, as in PyTorch
