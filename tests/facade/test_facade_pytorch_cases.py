"""PyTorch's own grad-scaling test scenarios, reproduced with jaxscale.GradScaler.

Each case of PyTorch's ``test_grad_scaling_*`` (via ``_run_scaling_case``: init
scale 128, growth factor 2, growth interval 1, four iterations, an inf injected at
iteration 2) runs three times: with jaxscale, as an unscaled JAX control (which
simply does not step at the skipped iteration), and with PyTorch itself on the
same weights and data. jaxscale must end at PyTorch's expected scale, match the
control as PyTorch's test requires (atol 1e-7, rtol 1e-5), and match PyTorch's
own run.
"""

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx
from support import third_party
from support import torch_twins as tw

import jaxscale

SKIP_ITER = 2
MAX_NORM = 0.2


def add(a, b):
    return jax.tree.map(jnp.add, a, b)


# -- the scenarios, in JAX: run(data, model, optimizer, scaler, scaling) ---------------------------


def jax_basic(data, model, optimizer, scaler, scaling, pickle_each_step=False):
    for i, (x, y) in enumerate(data):
        if scaling:
            grads = nnx.grad(lambda m, x=x, y=y, s=scaler: s.scale(tw.mse(m, x, y)))(model)
            if i == SKIP_ITER and scaler.is_enabled():
                grads = tw.poison_layer(grads)
            scaler.step(optimizer, model, grads)
            scaler.update()
            if pickle_each_step:
                scaler = pickle.loads(pickle.dumps(scaler))
        else:
            grads = nnx.grad(lambda m, x=x, y=y: tw.mse(m, x, y))(model)
            if not scaler.is_enabled() or i != SKIP_ITER:
                optimizer.update(model, grads)
    return scaler


def jax_clipping(data, model, optimizer, scaler, scaling):
    for i, (x, y) in enumerate(data):
        if scaling:
            grads = nnx.grad(lambda m, x=x, y=y, s=scaler: s.scale(tw.mse(m, x, y)))(model)
            grads = tw.clip_like_torch(grads, MAX_NORM * scaler.get_scale())
            if i == SKIP_ITER and scaler.is_enabled():
                grads = tw.poison_layer(grads)
            scaler.step(optimizer, model, grads)
            scaler.update()
        else:
            grads = tw.clip_like_torch(
                nnx.grad(lambda m, x=x, y=y: tw.mse(m, x, y))(model), MAX_NORM
            )
            if not scaler.is_enabled() or i != SKIP_ITER:
                optimizer.update(model, grads)
    return scaler


def jax_clipping_separate_unscale(data, model, optimizer, scaler, scaling):
    for i, (x, y) in enumerate(data):
        if scaling:
            grads = nnx.grad(lambda m, x=x, y=y, s=scaler: s.scale(tw.mse(m, x, y)))(model)
            if i == SKIP_ITER and scaler.is_enabled():
                grads = tw.poison_layer(grads)
            grads = scaler.unscale_(optimizer, grads)
            grads = tw.clip_like_torch(grads, MAX_NORM)
            scaler.step(optimizer, model, grads)
            scaler.update()
        else:
            grads = tw.clip_like_torch(
                nnx.grad(lambda m, x=x, y=y: tw.mse(m, x, y))(model), MAX_NORM
            )
            if not scaler.is_enabled() or i != SKIP_ITER:
                optimizer.update(model, grads)
    return scaler


def jax_penalty(data, model, optimizer, scaler, scaling):
    graphdef, params = nnx.split(model)

    def loss_at(p, x, y):
        return tw.mse(nnx.merge(graphdef, p), x, y)

    for i, (x, y) in enumerate(data):
        params = nnx.state(model)
        if scaling:

            def penalised(p, x=x, y=y):
                grad_params = jax.grad(lambda q: scaler.scale(loss_at(q, x, y)))(p)
                inv_scale = 1.0 / scaler.get_scale()
                grad_params = jax.tree.map(lambda g: g * inv_scale, grad_params)
                norm = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grad_params)))
                return scaler.scale(loss_at(p, x, y) + norm)

            grads = jax.grad(penalised)(params)
            if i == SKIP_ITER and scaler.is_enabled():
                grads = tw.poison_layer(grads)
            scaler.step(optimizer, model, grads)
            scaler.update()
        else:

            def penalised(p, x=x, y=y):
                grad_params = jax.grad(lambda q: loss_at(q, x, y))(p)
                norm = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grad_params)))
                return loss_at(p, x, y) + norm

            grads = jax.grad(penalised)(params)
            if not scaler.is_enabled() or i != SKIP_ITER:
                optimizer.update(model, grads)
    return scaler


def jax_accumulation(data, model, optimizer, scaler, scaling):
    iters_to_accumulate, accumulated = 2, None
    for i, (x, y) in enumerate(data):
        if scaling:
            grads = nnx.grad(
                lambda m, x=x, y=y: scaler.scale(tw.mse(m, x, y) / iters_to_accumulate)
            )(model)
        else:
            grads = nnx.grad(lambda m, x=x, y=y: tw.mse(m, x, y) / iters_to_accumulate)(model)
        accumulated = grads if accumulated is None else add(accumulated, grads)
        if (i + 1) % iters_to_accumulate == 0:
            if scaling:
                scaler.step(optimizer, model, accumulated)
                scaler.update()
            else:
                optimizer.update(model, accumulated)
            accumulated = None
    return scaler


# -- the same scenarios, in PyTorch (its test code, on the CPU) ------------------


def torch_basic(data, model, optimizer, scaler, scaling, pickle_each_step=False):
    loss_fn = torch.nn.MSELoss()
    for i, (x, y) in enumerate(data):
        optimizer.zero_grad()
        loss = loss_fn(model(torch.from_numpy(x)), torch.from_numpy(y))
        if scaling:
            scaler.scale(loss).backward()
            if i == SKIP_ITER and scaler.is_enabled():
                model[1].weight.grad.data.fill_(float("inf"))
            scaler.step(optimizer)
            scaler.update()
            if pickle_each_step:
                scaler = pickle.loads(pickle.dumps(scaler))
        else:
            loss.backward()
            if not scaler.is_enabled() or i != SKIP_ITER:
                optimizer.step()
    return scaler


def torch_clipping(data, model, optimizer, scaler, scaling):
    loss_fn = torch.nn.MSELoss()
    for i, (x, y) in enumerate(data):
        optimizer.zero_grad()
        loss = loss_fn(model(torch.from_numpy(x)), torch.from_numpy(y))
        scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM * scaler.get_scale())
        if i == SKIP_ITER and scaler.is_enabled():
            model[1].weight.grad.data.fill_(float("inf"))
        scaler.step(optimizer)
        scaler.update()
    return scaler


def torch_clipping_separate_unscale(data, model, optimizer, scaler, scaling):
    loss_fn = torch.nn.MSELoss()
    for i, (x, y) in enumerate(data):
        optimizer.zero_grad()
        loss = loss_fn(model(torch.from_numpy(x)), torch.from_numpy(y))
        scaler.scale(loss).backward()
        if i == SKIP_ITER and scaler.is_enabled():
            model[1].weight.grad.data.fill_(float("inf"))
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        scaler.step(optimizer)
        scaler.update()
    return scaler


def torch_penalty(data, model, optimizer, scaler, scaling):
    loss_fn = torch.nn.MSELoss()
    for i, (x, y) in enumerate(data):
        optimizer.zero_grad()
        loss = loss_fn(model(torch.from_numpy(x)), torch.from_numpy(y))
        grad_params = torch.autograd.grad(scaler.scale(loss), model.parameters(), create_graph=True)
        inv_scale = 1.0 / scaler.get_scale()
        grad_params = [p * inv_scale for p in grad_params]
        grad_norm = 0
        for grad in grad_params:
            grad_norm += grad.pow(2).sum()
        loss = loss + grad_norm.sqrt()
        scaler.scale(loss).backward()
        if i == SKIP_ITER and scaler.is_enabled():
            model[1].weight.grad.data.fill_(float("inf"))
        scaler.step(optimizer)
        scaler.update()
    return scaler


def torch_accumulation(data, model, optimizer, scaler, scaling):
    loss_fn = torch.nn.MSELoss()
    iters_to_accumulate = 2
    for i, (x, y) in enumerate(data):
        loss = loss_fn(model(torch.from_numpy(x)), torch.from_numpy(y)) / iters_to_accumulate
        scaler.scale(loss).backward()
        if (i + 1) % iters_to_accumulate == 0:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    return scaler


# (jax run, torch run, unskipped, skipped, extra kwargs)
CASES = {
    "basic": (jax_basic, torch_basic, 3, 1, {}),
    "basic, pickled every step": (jax_basic, torch_basic, 3, 1, {"pickle_each_step": True}),
    "clipping": (jax_clipping, torch_clipping, 3, 1, {}),
    "clipping, separate unscale_": (
        jax_clipping_separate_unscale,
        torch_clipping_separate_unscale,
        3,
        1,
        {},
    ),
    "gradient penalty": (jax_penalty, torch_penalty, 3, 1, {}),
    "accumulation": (jax_accumulation, torch_accumulation, 2, 0, {}),
}


def assert_params_close(got, expected, atol, rtol):
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, atol=atol, rtol=rtol)


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_pytorch_scaling_case(case, enabled):
    jax_run, torch_run, unskipped, skipped, kwargs = CASES[case]
    seed = 11
    data = tw.data(seed)
    torch_control = tw.torch_model(seed)

    # jaxscale, and the unscaled JAX control
    tx, torch_optimizer, torch_kwargs = tw.optimizers("sgd", 1.0)
    control, scaled = tw.twin(torch_control), tw.twin(torch_control)
    control_opt = nnx.Optimizer(control, tx, wrt=nnx.Param)
    scaled_opt = nnx.Optimizer(scaled, tx, wrt=nnx.Param)
    scaler = jaxscale.GradScaler(
        init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1
    )
    jax_run(data, control, control_opt, scaler, False)
    scaler = jax_run(data, scaled, scaled_opt, scaler, True, **kwargs)

    # PyTorch itself
    torch_scaled = tw.torch_model(seed)
    torch_scaler = torch.amp.GradScaler(
        "cpu", init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1
    )
    torch_scaler = torch_run(
        data,
        torch_scaled,
        torch_optimizer(torch_scaled.parameters(), **torch_kwargs),
        torch_scaler,
        True,
        **kwargs,
    )

    if enabled:
        expected_scale = 128.0 * 2.0**unskipped * 0.5**skipped
        assert scaler.get_scale() == expected_scale == torch_scaler.get_scale()
    else:
        assert scaler.get_scale() == 1.0 == torch_scaler.get_scale()
    assert_params_close(tw.nnx_params(scaled), tw.nnx_params(control), atol=1e-7, rtol=1e-5)
    assert_params_close(tw.nnx_params(scaled), tw.torch_params(torch_scaled), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("enabled", [True, False])
def test_pytorch_multiple_optimizers_case(enabled):
    # PyTorch's test_grad_scaling_multiple: two models and optimizers, two losses that use
    # both, an inf in model1's gradients at iteration 2, and a separate unscale_ for optimizer0.
    seed = 5
    data = tw.data(seed)
    torch0, torch1 = tw.torch_model(seed), tw.torch_model(seed + 1)

    def jax_run(model0, model1, optimizer0, optimizer1, scaler, scaling):
        def losses(m0, m1, x, y):
            out0, out1 = m0(jnp.asarray(x)), m1(jnp.asarray(x))
            target = jnp.asarray(y)
            return jnp.mean((0.3 * out0 + 0.7 * out1 - target) ** 2), jnp.mean(
                (0.6 * out0 - 0.4 * out1 - target) ** 2
            )

        for i, (x, y) in enumerate(data):
            wrap = scaler.scale if scaling else (lambda loss: loss)
            g0 = nnx.grad(
                lambda a, b, x=x, y=y, wrap=wrap: wrap(losses(a, b, x, y)[0]), argnums=(0, 1)
            )(model0, model1)
            g1 = nnx.grad(
                lambda a, b, x=x, y=y, wrap=wrap: wrap(losses(a, b, x, y)[1]), argnums=(0, 1)
            )(model0, model1)
            grads0, grads1 = add(g0[0], g1[0]), add(g0[1], g1[1])
            if scaling:
                if i == SKIP_ITER and scaler.is_enabled():
                    grads1 = tw.poison_layer(grads1)
                grads0 = scaler.unscale_(optimizer0, grads0)
                scaler.step(optimizer0, model0, grads0)
                scaler.step(optimizer1, model1, grads1)
                scaler.update()
            else:
                optimizer0.update(model0, grads0)
                if not scaler.is_enabled() or i != SKIP_ITER:
                    optimizer1.update(model1, grads1)

    tx = third_party.optimizer(optax.sgd(1.0))
    models = [tw.twin(torch0), tw.twin(torch1), tw.twin(torch0), tw.twin(torch1)]
    opts = [nnx.Optimizer(m, tx, wrt=nnx.Param) for m in models]
    scaler = jaxscale.GradScaler(
        init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1
    )
    jax_run(models[0], models[1], opts[0], opts[1], scaler, False)
    jax_run(models[2], models[3], opts[2], opts[3], scaler, True)

    torch_scaler = torch.amp.GradScaler(
        "cpu", init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1
    )
    opt0 = torch.optim.SGD(torch0.parameters(), lr=1.0)
    opt1 = torch.optim.SGD(torch1.parameters(), lr=1.0)
    loss_fn = torch.nn.MSELoss()
    for i, (x, y) in enumerate(data):
        opt0.zero_grad()
        opt1.zero_grad()
        xt, yt = torch.from_numpy(x), torch.from_numpy(y)
        out0, out1 = torch0(xt), torch1(xt)
        loss0 = loss_fn(0.3 * out0 + 0.7 * out1, yt)
        loss1 = loss_fn(0.6 * out0 - 0.4 * out1, yt)
        torch_scaler.scale(loss0).backward(retain_graph=True)
        torch_scaler.scale(loss1).backward()
        if i == SKIP_ITER and torch_scaler.is_enabled():
            torch1[1].weight.grad.data.fill_(float("inf"))
        torch_scaler.unscale_(opt0)
        torch_scaler.step(opt0)
        torch_scaler.step(opt1)
        torch_scaler.update()

    expected = 128.0 * 2.0**3 * 0.5 if enabled else 1.0
    assert scaler.get_scale() == expected == torch_scaler.get_scale()
    for control, scaled in [(models[0], models[2]), (models[1], models[3])]:
        assert_params_close(tw.nnx_params(scaled), tw.nnx_params(control), atol=1e-7, rtol=1e-5)
    assert_params_close(tw.nnx_params(models[2]) + tw.nnx_params(models[3]),
                        tw.torch_params(torch0) + tw.torch_params(torch1),
                        atol=1e-6, rtol=1e-5)  # fmt: skip
