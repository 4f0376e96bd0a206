"""Module systems that keep state where autocast cannot reach it: Linen and Haiku.

Autocast traces its function to a jaxpr. Flax NNX modules are passed in as
objects, so their state is split out and threaded through (:mod:`._state`). A
Flax Linen module method and a function inside ``hk.transform`` instead reach
their parameters and state through a context the framework holds while it runs
(Linen's scope, Haiku's frame); a parameter created or a state written there
during autocast's trace would be a tracer left behind in that context, which JAX
reports later as a generic ``UnexpectedTracerError``. So autocast refuses to
start inside one, naming what works: autocast around ``apply`` or around the loss.

Neither framework is imported here: each is looked up in ``sys.modules``, so a
program that never imported it pays nothing.
"""

from __future__ import annotations

import sys


def hidden_state_context() -> str | None:
    """The framework whose state context is active now (``"Flax Linen"`` or ``"Haiku"``)."""
    linen_module = sys.modules.get("flax.linen.module")
    if linen_module is not None:
        stack = getattr(getattr(linen_module, "_context", None), "module_stack", None)
        if stack and stack[-1] is not None:
            return "Flax Linen"
    haiku_base = sys.modules.get("haiku._src.base")
    if haiku_base is not None:
        inside = getattr(haiku_base, "inside_transform", None)
        if callable(inside) and inside():
            return "Haiku"
    return None


def refuse_inside_hidden_state(function_name: str) -> None:
    """Raise ``RuntimeError`` when autocast is called inside a Linen module or Haiku transform."""
    framework = hidden_state_context()
    if framework is None:
        return
    where = "a Flax Linen module method" if framework == "Flax Linen" else "hk.transform"
    remedy = (
        "jaxscale.autocast(model.apply)(variables, x)"
        if framework == "Flax Linen"
        else "jaxscale.autocast(transformed.apply)(params, rng, x)"
    )
    raise RuntimeError(
        f"jaxscale.autocast({function_name}) was called inside {where}. {framework} keeps "
        "parameters and state in a context of its own, which autocast's trace cannot carry "
        "(a parameter created or state written there would leak a tracer). Apply autocast "
        f"outside the module instead: {remedy}, or around the loss function that calls "
        "apply. Inside it, jaxscale.autocast(fn, enabled=False) marks a region to run "
        "without casts."
    )
