"""Evaluating a jaxpr anew while carrying something beside its values.

Each equation is bound as it was traced (so every value is bitwise the program's
own) inside its own context, and after each one a hook may update a *carry*: a
pytree of arrays threaded through the evaluation. Loops carry it with an
iteration count, conditionals pass it through the branch taken, checkpointed code
carries it through the checkpoint, nested ``jit`` calls are evaluated in place.
The carry is ordinary traced data: it runs inside ``jit`` with no callback and no
transfer. :mod:`._locate` carries the first origin of a non-finite value,
:mod:`._stats` the ranges of every matmul.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import jaxpr_as_fun

from jaxscale._src.frames import Location, location
from jaxscale._src.jaxprs import (
    bind_in_context,
    called_program,
    equation_context,
    equation_frames,
    is_literal,
    is_variable,
    jit_source,
    literal_value,
    parameters,
    scan_operand_groups,
)
from jaxscale.diagnosis._phases import backward_equations

NOT_IN_A_LOOP = -1


class Phase(NamedTuple):
    """An equation's phase: backward as a whole, and per output whether only the
    backward pass uses it (what an inner jaxpr's outputs inherit)."""

    backward: bool
    outputs: list[bool]

    def inner(self) -> dict[str, Any]:
        return {"backward": self.backward, "backward_outputs": self.outputs}


class EquationRun(NamedTuple):
    """One equation as the evaluation ran it: what :meth:`CarryingEvaluator.after_equation`
    is given."""

    eqn: Any
    invals: list[Any]
    in_infos: list[Any]  # what was kept about each input (CarryingEvaluator.value_info)
    outvals: list[Any]
    out_infos: list[Any]
    iteration: Any  # the loop iteration it ran in, or NOT_IN_A_LOOP
    phase: Phase
    here: Location  # the user's line that traced it


class CarryingEvaluator:
    """Evaluates jaxprs, threading a carry that :meth:`after_equation` updates."""

    def value_info(self, value: Any) -> Any:
        """What the evaluation keeps about each value beside it (``None`` by default)."""
        return None

    def output_infos(
        self, eqn: Any, invals: list[Any], in_infos: list[Any], outvals: list[Any]
    ) -> list[Any]:
        """What is kept about an equation's outputs: :meth:`value_info` of each, unless a
        subclass knows it from the inputs (their values or what was kept about them)."""
        return [self.value_info(value) for value in outvals]

    def after_equation(self, ran: EquationRun, carry: Any) -> Any:
        """The carry after ``ran.eqn`` ran (called once the equation's outputs exist)."""
        return carry

    def settle(self, carry: Any, iteration: Any) -> Any:
        """The carry with everything :meth:`after_equation` put aside folded in; called
        before a higher-order equation runs and when a jaxpr ends (by default, nothing
        is put aside)."""
        return carry

    def finish(self, carry: Any, iteration: Any, out_infos: list[Any]) -> Any:
        """The carry when a jaxpr (not evaluated inline) ends, ``out_infos`` being what is
        kept about its outputs: by default, :meth:`settle`'s."""
        return self.settle(carry, iteration)

    def link_outputs(self, values: Sequence[Any]) -> None:
        """Called by a rule whose equation's outputs are computed as ``values`` are (a
        custom derivative's body, evaluated beside the equation bound as traced),
        before :meth:`after_equation` of that equation."""

    def loop_carry(self, carry: Any, body: Callable[[Any], Any]) -> Any:
        """``carry`` completed to the structure ``body(carry)`` returns, so that a loop
        can carry it (for carries that grow as equations are found)."""
        return carry

    # -- evaluation -------------------------------------------------------------------

    def eval(
        self,
        jaxpr: Any,
        consts: Sequence[Any],
        args: Sequence[Any],
        carry: Any,
        iteration: Any,
        *,
        backward: bool = False,
        backward_outputs: Sequence[bool] | None = None,
        place: Location | None = None,
        inline: bool = False,
    ) -> tuple[list[Any], Any]:
        """Evaluate an open jaxpr on ``args``; returns its outputs and the carry.

        ``backward``: the jaxpr runs in a backward pass as a whole.
        ``backward_outputs``: which of its outputs only the backward pass uses.
        ``place``: the location of the equation that contains this jaxpr, used for
        the equations of a library's jitted function.
        ``inline``: the jaxpr is evaluated in its caller's trace (a nested ``jit``):
        what its equations put aside stays with the caller's, and is settled with them.
        """
        env: dict[Any, Any] = {}
        infos: dict[Any, Any] = {}

        def read(atom: Any) -> Any:
            return literal_value(atom) if is_literal(atom) else env[atom]

        def info_of(atom: Any) -> Any:
            return self.value_info(literal_value(atom)) if is_literal(atom) else infos[atom]

        def write(var: Any, value: Any, info: Any) -> None:
            if is_variable(var):
                env[var] = value
                infos[var] = info

        for var, value in zip(jaxpr.constvars, consts, strict=True):
            write(var, value, self.value_info(value))
        for var, value in zip(jaxpr.invars, args, strict=True):
            write(var, value, self.value_info(value))
        phases, output_phases = backward_equations(jaxpr, backward, backward_outputs)

        for eqn, eqn_backward, out_backward in zip(jaxpr.eqns, phases, output_phases, strict=True):
            invals = [read(v) for v in eqn.invars]
            in_infos = [info_of(v) for v in eqn.invars]
            here = self._location(eqn, place)
            phase = Phase(eqn_backward, out_backward)
            with equation_context(eqn):
                rule = _RULES.get(eqn.primitive.name)
                if rule is None:
                    outvals = bind_in_context(eqn, invals)
                else:
                    if rule not in _INLINE_RULES:  # a body traced apart needs the carry now
                        carry = self.settle(carry, iteration)
                    enclosing = self._enclosing()
                    enclosing.append(here)
                    try:
                        outvals, carry = rule(
                            self, eqn, invals, carry, iteration, phase, here, **parameters(eqn)
                        )
                    finally:
                        enclosing.pop()
                out_infos = self.output_infos(eqn, invals, in_infos, outvals)
                for var, value, info in zip(eqn.outvars, outvals, out_infos, strict=True):
                    write(var, value, info)
                ran = EquationRun(eqn, invals, in_infos, outvals, out_infos, iteration, phase, here)
                carry = self.after_equation(ran, carry)
        outs = [read(v) for v in jaxpr.outvars]
        if inline:
            return outs, carry
        return outs, self.finish(carry, iteration, [info_of(v) for v in jaxpr.outvars])

    def _location(self, eqn: Any, place: Location | None) -> Location:
        if place is not None and place.user:
            # inside a library's jitted function: the containing equation's line (the
            # library's traced code may have been cached from another call site)
            return place
        found = location(equation_frames(eqn))
        if found.user:
            return found
        # JAX keeps only the innermost frames of a traceback, and the body of a
        # library's loop (nnx.RNN's scan over an LSTMCell) may keep no frame of the
        # user's: the user's line is then that of the loop, the innermost enclosing
        # equation that has one.
        outer = next((where for where in reversed(self._enclosing()) if where.user), None)
        if outer is None:
            return found
        return Location(outer.user, found.library or outer.library, outer.path)

    def _enclosing(self) -> list[Location]:
        """The locations of the higher-order equations being evaluated, outermost first."""
        return self.__dict__.setdefault("_enclosing_locations", [])


# -- higher-order equations ------------------------------------------------------------------

# ``rule(evaluator, eqn, invals, carry, iteration, phase, here, **parameters)``: the
# equation's outputs and the carry after it, the equation's parameters as keywords.
Rule = Callable[..., tuple[list[Any], Any]]
_RULES: dict[str, Rule] = {}


# Rules that evaluate their jaxprs in the caller's trace, with ``inline=True``: the
# equations before them need not be settled first, and theirs are settled with the
# caller's. (A float8 matmul is made of dozens of small jitted functions; settling each
# apart made its instrumented program 20 times the size of the plain one.)
_INLINE_RULES: list[Rule] = []


def runs_apart(eqn: Any) -> bool:
    """Whether ``eqn`` is a higher-order equation whose jaxprs are evaluated in traces of
    their own (a loop's body, a branch, a checkpointed body)."""
    rule = _RULES.get(eqn.primitive.name)
    return rule is not None and rule not in _INLINE_RULES


def _rule(*names: str, inline: bool = False) -> Callable[[Rule], Rule]:
    def register(rule: Rule) -> Rule:
        for name in names:
            _RULES[name] = rule
        if inline:
            _INLINE_RULES.append(rule)
        return rule

    return register


def _inner_place(eqn: Any, here: Location) -> Location | None:
    """The location a jitted function's equations take: their own in the user's function,
    the call's in a library's (whose traced code may be cached from another call)."""
    source = jit_source(eqn)
    file = source.rsplit(" at ", 1)[-1].rsplit(":", 1)[0] if source else ""
    if file and location([(file, 0, "")]).user:
        return None
    return here


@_rule("jit", "closed_call", inline=True)  # closed_call: JAX 0.10 only
def _inline(evaluator: CarryingEvaluator, eqn: Any, invals: list[Any], carry: Any,
            iteration: Any, phase: Phase, here: Location,
            **params: Any) -> tuple[list[Any], Any]:  # fmt: skip
    jaxpr, consts = called_program(eqn)
    return evaluator.eval(
        jaxpr, consts, invals, carry, iteration,
        place=_inner_place(eqn, here), inline=True, **phase.inner(),
    )  # fmt: skip


@_rule("scan")
def _scan(evaluator: CarryingEvaluator, eqn: Any, invals: list[Any], carry: Any,
          iteration: Any, phase: Phase, here: Location,
          **params: Any) -> tuple[list[Any], Any]:  # fmt: skip
    body = params["jaxpr"]
    consts, init, xs = scan_operand_groups(params, invals)
    first_x = [x[0] for x in xs]

    def step(state: Any, x: list[Any]) -> tuple[Any, list[Any]]:
        values, carry, count = state
        outs, carry = evaluator.eval(
            body.jaxpr, body.consts, [*consts, *values, *x], carry, count, **phase.inner()
        )
        return (outs[: len(init)], carry, count + 1), outs[len(init) :]

    counter = jnp.zeros((), jnp.int32)
    carry = evaluator.loop_carry(carry, lambda c: step((list(init), c, counter), first_x)[0][1])
    (values, carry, _), ys = lax.scan(
        step,
        (list(init), carry, counter),
        list(xs),
        length=params["length"],
        reverse=params["reverse"],
        unroll=params["unroll"],
    )
    return [*values, *ys], carry


@_rule("while")
def _while(evaluator: CarryingEvaluator, eqn: Any, invals: list[Any], carry: Any,
           iteration: Any, phase: Phase, here: Location,
           **params: Any) -> tuple[list[Any], Any]:  # fmt: skip
    cond, body = params["cond_jaxpr"], params["body_jaxpr"]
    cond_consts = invals[: params["cond_nconsts"]]
    rest = invals[params["cond_nconsts"] :]
    body_consts, init = rest[: params["body_nconsts"]], rest[params["body_nconsts"] :]

    def keep_going(state: Any) -> Any:
        values, _, _ = state
        return jaxpr_as_fun(cond)(*cond_consts, *values)[0]

    def step(state: Any) -> Any:
        values, carry, count = state
        outs, carry = evaluator.eval(
            body.jaxpr, body.consts, [*body_consts, *values], carry, count, **phase.inner()
        )
        return outs, carry, count + 1

    counter = jnp.zeros((), jnp.int32)
    carry = evaluator.loop_carry(carry, lambda c: step((list(init), c, counter))[1])
    values, carry, _ = lax.while_loop(keep_going, step, (list(init), carry, counter))
    return list(values), carry


@_rule("cond")
def _cond(evaluator: CarryingEvaluator, eqn: Any, invals: list[Any], carry: Any,
          iteration: Any, phase: Phase, here: Location,
          **params: Any) -> tuple[list[Any], Any]:  # fmt: skip
    index, operands = invals[0], invals[1:]

    def branch(closed: Any) -> Callable[..., Any]:
        def run(carry: Any, *ops: Any) -> tuple[list[Any], Any]:
            return evaluator.eval(
                closed.jaxpr, closed.consts, ops, carry, iteration, **phase.inner()
            )

        return run

    branches = [branch(b) for b in params["branches"]]

    def carry_after(run: Callable[..., tuple[list[Any], Any]]) -> Callable[[Any], Any]:
        return lambda c: run(c, *operands)[1]

    for run in branches:  # every branch's carry has the same structure
        carry = evaluator.loop_carry(carry, carry_after(run))
    outs, carry = lax.switch(index, branches, carry, *operands)
    return list(outs), carry


@_rule("remat2")  # jax.checkpoint, nnx.remat
def _remat(evaluator: CarryingEvaluator, eqn: Any, invals: list[Any], carry: Any,
           iteration: Any, phase: Phase, here: Location,
           **params: Any) -> tuple[list[Any], Any]:  # fmt: skip
    jaxpr = params["jaxpr"]

    def body(carry: Any, iteration: Any, *args: Any) -> tuple[list[Any], Any]:
        return evaluator.eval(jaxpr, [], args, carry, iteration, **phase.inner())

    rematted = jax.checkpoint(body, prevent_cse=params["prevent_cse"], policy=params["policy"])
    outs, carry = rematted(carry, jnp.asarray(iteration, jnp.int32), *invals)
    return list(outs), carry


@_rule("custom_jvp_call", "custom_vjp_call", inline=True)
def _custom(evaluator: CarryingEvaluator, eqn: Any, invals: list[Any], carry: Any,
            iteration: Any, phase: Phase, here: Location,
            **params: Any) -> tuple[list[Any], Any]:  # fmt: skip
    # The equation is bound as traced, so its rules stay for a differentiation outside;
    # its body is evaluated beside it for the carry (XLA computes the common part once).
    outs = bind_in_context(eqn, invals)
    call = params["call_jaxpr"]
    body_outs, carry = evaluator.eval(
        call.jaxpr, call.consts, invals, carry, iteration, inline=True, **phase.inner()
    )
    evaluator.link_outputs(body_outs)
    return outs, carry
