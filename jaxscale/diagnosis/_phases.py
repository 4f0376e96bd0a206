"""Forward or backward: which equations of a traced program belong to a backward pass.

JAX names the equations of a backward pass ``transpose(jvp(...))`` in their name
stack. The forward pass of a ``jax.grad`` also computes values the backward pass
alone uses (the derivative terms of a JVP rule, such as ``0.5 / sqrt(x)``); they
count as backward too. So an equation is backward when it is transposed, or when
every use of every output it has is backward: by a backward equation, or as an
output of the program that only the backward pass uses. The program's own outputs
are backward-used when a backward equation computed them (the gradients).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

from jaxscale._src.jaxprs import is_variable, name_stack_text


def backward_equations(
    jaxpr: Any, backward: bool, backward_outputs: Sequence[bool] | None
) -> tuple[list[bool], list[list[bool]]]:
    """Per equation of ``jaxpr``: whether it is backward, and per output whether only
    the backward pass uses it.

    ``backward``: the whole jaxpr runs in a backward pass. ``backward_outputs``: per
    output of the jaxpr, whether only the backward pass uses it (``None`` for a
    program's top level, where a gradient is what a backward equation computed).
    """
    eqns = jaxpr.eqns
    if backward:
        return [True] * len(eqns), [[True] * len(e.outvars) for e in eqns]
    transposed = ["transpose(" in name_stack_text(e) for e in eqns]
    consumers: dict[Any, list[int]] = collections.defaultdict(list)
    for index, eqn in enumerate(eqns):
        for var in eqn.invars:
            if is_variable(var):
                consumers[var].append(index)
    if backward_outputs is None:
        producer = {v: i for i, e in enumerate(eqns) for v in e.outvars if is_variable(v)}
        backward_outputs = [
            is_variable(v) and v in producer and transposed[producer[v]] for v in jaxpr.outvars
        ]
    output_uses: dict[Any, list[bool]] = collections.defaultdict(list)
    for var, flag in zip(jaxpr.outvars, backward_outputs, strict=True):
        if is_variable(var):
            output_uses[var].append(bool(flag))

    equation_flags = [False] * len(eqns)
    output_flags: list[list[bool]] = [[] for _ in eqns]
    for index in reversed(range(len(eqns))):
        eqn = eqns[index]
        if transposed[index]:
            equation_flags[index] = True
            output_flags[index] = [True] * len(eqn.outvars)
            continue
        per_output = []
        for var in eqn.outvars:
            uses = []
            if is_variable(var):
                uses = [equation_flags[c] for c in consumers[var]] + output_uses[var]
            per_output.append(bool(uses) and all(uses))
        output_flags[index] = per_output
        used = [
            f
            for f, v in zip(per_output, eqn.outvars, strict=True)
            if _is_used(v, consumers, output_uses)
        ]
        equation_flags[index] = bool(used) and all(used)
    return equation_flags, output_flags


def _is_used(var: Any, consumers: dict[Any, list[int]], output_uses: dict[Any, list[bool]]) -> bool:
    return is_variable(var) and bool(consumers.get(var) or output_uses.get(var))
