"""``precision_stats``: the ranges every matmul and convolution of a call works in.

The same evaluation as :func:`jaxscale.locate_nonfinite` (every value bitwise the
function's own), carrying per matmul the largest magnitude of each operand and of
the output, and how many output elements fell below the output dtype's smallest
normal number (flushed to zero or subnormal) or overflowed to infinity; for a float8
matmul, how much of each operand its cast to float8 lost. Inside loops the figures
accumulate over iterations. These are the numbers that choose between float16 and
bfloat16, a loss scale, or a float8 recipe.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale._src.frames import Location
from jaxscale._src.jaxprs import call_name, is_traced
from jaxscale._src.stateful_call import TracedCall
from jaxscale.diagnosis._evaluator import NOT_IN_A_LOOP, CarryingEvaluator, EquationRun, Phase

F = TypeVar("F", bound=Callable[..., Any])
MATMULS = ("dot_general", "conv_general_dilated")
_FIELDS = (
    "lhs_amax", "rhs_amax", "out_amax", "small", "overflow", "elements",
    "lhs_cast_lost", "lhs_cast_elements", "rhs_cast_lost", "rhs_cast_elements",
)  # fmt: skip
FLOAT8_DTYPES = tuple(
    np.dtype(t) for t in (jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float8_e4m3fnuz,
                          jnp.float8_e5m2fnuz, jnp.float8_e4m3b11fnuz)
)  # fmt: skip
# The jit call in which quantize_float8 casts (casting/_float8.py's cast_to_float8): its
# input is the high-precision tensor and its scale. Named here, not imported: diagnosis/
# builds on core/ alone; a test checks the name against the function.
FLOAT8_CAST = "cast_to_float8"
# The jit calls in which quantize_mx and dequantize_mx work (casting/_mx.py): the first
# takes the high-precision tensor and gives its MX data and scales, the second gives the
# values a matmul of an MX recipe multiplies (in bfloat16 or float32, so the matmul's own
# dtypes do not show the MX format: the figures travel from the one call to the other).
MX_QUANTIZE = "quantize_to_mx_blocks"
MX_DEQUANTIZE = ("dequantize_mx_blocks", "dequantize_mx_whole")  # the second: all_gather_in_mx
# Operations after a float8 cast that keep its figures with the data (the float8 matmul
# puts its operands through an optimization barrier; a hand-written one may reshape them).
_KEEPS_CAST = ("optimization_barrier", "reshape", "transpose", "squeeze", "expand_dims", "copy")


def _empty() -> dict[str, jax.Array]:
    return {name: jnp.zeros((), jnp.float32) for name in _FIELDS}


def _merge(old: dict[str, jax.Array], new: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return {
        name: jnp.maximum(old[name], new[name]) if name.endswith("amax") else old[name] + new[name]
        for name in _FIELDS
    }


def _amax(value: Any) -> jax.Array:
    return jnp.max(jnp.abs(value)).astype(jnp.float32)


def is_float8(dtype: Any) -> bool:
    return np.dtype(dtype) in FLOAT8_DTYPES


def _cast_figures(before: jax.Array, after: jax.Array) -> dict[str, jax.Array]:
    """What a cast to float8 was given and lost: the largest magnitude before it, the
    elements non-zero before it that are zero or subnormal after it, and the count of
    elements."""
    tiny = float(jnp.finfo(after.dtype).tiny)
    lost = (before != 0) & (jnp.abs(after.astype(jnp.float32)) < tiny)
    return {
        "amax": _amax(before),
        "lost": jnp.sum(lost).astype(jnp.float32),
        "elements": jnp.float32(after.size),
    }


def _unscaled(out: jax.Array, lhs_cast: Any, rhs_cast: Any) -> jax.Array:
    """A float8 matmul's output with both operands' scales divided out, where both are
    known and broadcast against it (as ``quantize_float8``'s do for ``(M, K) @ (K, N)``);
    else the output as computed."""
    if not (lhs_cast and rhs_cast and "scale" in lhs_cast and "scale" in rhs_cast):
        return out
    scales = lhs_cast["scale"] * rhs_cast["scale"]
    try:
        shape = np.broadcast_shapes(scales.shape, out.shape)
    except ValueError:
        return out
    return out / scales if shape == out.shape else out


def _fraction(part: jax.Array, whole: jax.Array) -> jax.Array:
    """``part / whole``, NaN where ``whole`` is 0 (nothing was measured)."""
    return jnp.where(whole > 0, part / jnp.maximum(whole, 1), jnp.nan)


class StatsCollector(CarryingEvaluator):
    """Carries ``{key: accumulators}`` for every matmul and convolution met."""

    def __init__(self) -> None:
        self._keys: dict[tuple[int, str], str] = {}
        self.float8_keys: set[str] = set()  # the keys of matmuls of float8 operands

    def key(self, eqn: Any, phase: Phase, here: Location, dtypes: str) -> str:
        """A stable, readable key: line, primitive, phase and dtypes, numbered when
        one line holds several (a layer's forward and its two backward matmuls differ by
        phase; an einsum of two products by number)."""
        base = (
            f"{here.user or here.library or 'unknown line'} {eqn.primitive.name} "
            f"{'backward' if phase.backward else 'forward'} ({dtypes})"
        )
        identity = (id(eqn), base)
        if identity not in self._keys:
            taken = sum(1 for key in self._keys.values() if key.split(" #")[0] == base)
            self._keys[identity] = base if taken == 0 else f"{base} #{taken + 1}"
        return self._keys[identity]

    def output_infos(
        self, eqn: Any, invals: list[Any], in_infos: list[Any], outvals: list[Any]
    ) -> list[Any]:
        """A cast to float8 keeps what it lost with its result, and the operations that
        only move the data on (:data:`_KEEPS_CAST`) pass that along, so the matmul that
        reads the float8 operand can report it."""
        name = eqn.primitive.name
        if name == "jit" and call_name(eqn) == FLOAT8_CAST:
            # quantize_float8's scaled cast: the high-precision tensor and its scale
            return [{**_cast_figures(invals[0], outvals[0]), "scale": invals[1]}]
        if name == "jit" and call_name(eqn) == MX_QUANTIZE:
            element = np.dtype(outvals[0].dtype).name
            return [{**_cast_figures(invals[0], outvals[0]), "format": f"mx {element}"}, None]
        if name == "jit" and call_name(eqn) in MX_DEQUANTIZE:
            return [in_infos[0]]  # the dequantized values are in the input's units
        if name == "convert_element_type" and is_float8(outvals[0].dtype):
            if not is_float8(invals[0].dtype):
                return [_cast_figures(invals[0], outvals[0])]
            return [in_infos[0]]
        if name == "optimization_barrier":
            return list(in_infos)
        if name in _KEEPS_CAST:
            return [in_infos[0], *[None] * (len(outvals) - 1)]
        return [None] * len(outvals)

    def after_equation(self, ran: EquationRun, carry: Any) -> Any:
        eqn, invals, in_infos = ran.eqn, ran.invals, ran.in_infos
        if eqn.primitive.name not in MATMULS:
            return carry
        out = ran.outvals[0]
        if not jnp.issubdtype(out.dtype, jnp.floating):
            return carry
        lhs, rhs = invals[0], invals[1]
        lhs_cast, rhs_cast = in_infos[0], in_infos[1]
        out = _unscaled(out, lhs_cast, rhs_cast)
        tiny = float(jnp.finfo(out.dtype).tiny)
        magnitude = jnp.abs(out)
        figures = {
            # a float8 operand's figure is that of the values its cast was given
            "lhs_amax": lhs_cast["amax"] if lhs_cast else _amax(lhs),
            "rhs_amax": rhs_cast["amax"] if rhs_cast else _amax(rhs),
            "out_amax": _amax(jnp.where(jnp.isfinite(out), out, 0)),
            "small": jnp.sum(magnitude < tiny).astype(jnp.float32),
            "overflow": jnp.sum(jnp.isinf(out)).astype(jnp.float32),
            "elements": jnp.float32(out.size),
        }
        for side, info in (("lhs", lhs_cast), ("rhs", rhs_cast)):
            cast = info or {"lost": jnp.float32(0), "elements": jnp.float32(0)}
            figures[f"{side}_cast_lost"] = cast["lost"]
            figures[f"{side}_cast_elements"] = cast["elements"]
        formats = [
            info["format"] if info and "format" in info else np.dtype(value.dtype).name
            for value, info in ((lhs, lhs_cast), (rhs, rhs_cast))
        ]
        mx = any(info and "format" in info for info in (lhs_cast, rhs_cast))
        float8 = is_float8(lhs.dtype) or is_float8(rhs.dtype) or mx
        dtypes = " @ ".join(formats) if float8 else np.dtype(out.dtype).name
        key = self.key(eqn, ran.phase, ran.here, dtypes)
        if float8:
            self.float8_keys.add(key)
        carry = dict(carry)
        carry[key] = _merge(carry.get(key, _empty()), figures)
        return carry

    def loop_carry(self, carry: Any, body: Callable[[Any], Any]) -> Any:
        shape = jax.eval_shape(body, carry)
        completed = dict(carry)
        for key in shape:
            completed.setdefault(key, _empty())
        return completed


def precision_stats(fn: F) -> Callable[..., tuple[Any, dict[str, dict[str, jax.Array]]]]:
    """The ranges every matmul and convolution of a call works in.

    ``precision_stats(fn)`` returns a function with ``fn``'s signature that returns
    ``(fn(*args, **kwargs), stats)``, the outputs bitwise ``fn``'s wherever XLA keeps
    every rounding the program writes: always on the CPU; on a GPU, XLA by default
    drops a float16 or bfloat16 rounding between operations it fuses
    (``--xla_allow_excess_precision``), and reading a value for the figures changes
    what it fuses, so the outputs may differ there by such a rounding unless
    ``XLA_FLAGS=--xla_allow_excess_precision=false``. ``stats`` maps
    each matmul or convolution, keyed ``"file.py:LINE primitive phase (dtype)"``
    (``phase`` is ``forward`` or ``backward``; ``#2``, ``#3`` number several on one
    line), to float32 scalar arrays:

    * ``lhs_amax``, ``rhs_amax``, ``out_amax``: the largest magnitude of each
      operand and of the (finite) output;
    * ``underflow``: the fraction of output elements below the output dtype's
      smallest normal number (zero or subnormal);
    * ``overflow``: the fraction of output elements that are infinite.

    A matmul of float8 operands (``autocast(..., float8=...)``, or
    :func:`jaxscale.quantize_float8` by hand) is keyed by its operands' types,
    ``"... dot_general backward (float8_e5m2 @ float8_e4m3fn)"``, and adds
    ``lhs_float8_underflow`` and ``rhs_float8_underflow``: the fraction of each
    operand's elements that were non-zero before the cast to float8 and are zero or
    subnormal after it (what the scale could not keep in float8's range; NaN for an
    operand that was not cast in the function). Its figures are in the units of the
    high-precision values: each operand's amax is that of the values its cast was
    given, and for operands cast by :func:`jaxscale.quantize_float8` (every recipe's)
    the output's figures are those of the product with both scales divided out.
    A matmul of operands quantized by :func:`jaxscale.quantize_mx` and dequantized by
    :func:`jaxscale.dequantize_mx` (the ``"mxfp8"`` recipes) is keyed by their MX
    element types, ``"... (mx float8_e4m3fn @ mx float8_e4m3fn)"``, with the same two
    columns: the fraction of each operand's non-zero elements whose MX data are zero or
    subnormal (what a block's shared scale could not keep, next to the block's largest).

    Inside loops the figures cover every iteration. It is jittable (no callback,
    no transfer) and composes with :func:`jaxscale.autocast`: wrap the autocast
    function to see the float16 or bfloat16 matmuls it runs.

    >>> import jax, jax.numpy as jnp, jaxscale
    >>> def layer(w, x):
    ...     return jnp.sum(jaxscale.autocast(lambda w, x: x @ w)(w, x).astype(jnp.float32))
    >>> _, stats = jaxscale.precision_stats(layer)(jnp.full((2, 2), 300.0), jnp.ones((1, 2)))
    >>> [(key.split()[-3:], float(s["out_amax"])) for key, s in stats.items()]
    [(['dot_general', 'forward', '(float16)'], 600.0)]
    """
    if not callable(fn):
        raise TypeError(f"precision_stats expects a callable, got {type(fn).__name__} {fn!r}")

    @functools.wraps(fn)
    def measured(*args: Any, **kwargs: Any) -> tuple[Any, dict[str, dict[str, jax.Array]]]:
        call = TracedCall(fn, args, kwargs)
        collector = StatsCollector()
        closed = call.closed
        outs, carry = collector.eval(closed.jaxpr, closed.consts, call.inputs, {}, NOT_IN_A_LOOP)
        stats = {key: _report(acc, key in collector.float8_keys) for key, acc in carry.items()}
        return call.finish(outs), stats

    return measured


_COLUMNS = (
    ("lhs_amax", "lhs amax"),
    ("rhs_amax", "rhs amax"),
    ("out_amax", "out amax"),
    ("underflow", "underflow"),
    ("overflow", "overflow"),
    ("lhs_float8_underflow", "lhs to float8 lost"),
    ("rhs_float8_underflow", "rhs to float8 lost"),
)
_FRACTIONS = {"underflow", "overflow", "lhs_float8_underflow", "rhs_float8_underflow"}


def format_precision_stats(stats: Mapping[str, Mapping[str, Any]]) -> str:
    """:func:`precision_stats`' figures as a table: one matmul or convolution a row, in
    the order of ``stats``; amaxes to four significant digits, fractions as percentages;
    the float8 columns only when a float8 matmul is present, ``-`` for the others'
    and ``n/a`` where an operand was not cast in the function. The figures must be
    concrete: format what a jitted function returned, outside it.

    >>> import jax, jax.numpy as jnp, jaxscale
    >>> def layer(w, x):
    ...     return jnp.sum(jaxscale.autocast(lambda w, x: x @ w)(w, x).astype(jnp.float32))
    >>> _, stats = jax.jit(jaxscale.precision_stats(layer))(
    ...     jnp.full((2, 2), 300.0), jnp.ones((1, 2)))
    >>> print(jaxscale.format_precision_stats(stats).split("\\n")[0].split())
    ['matmul', 'lhs', 'amax', 'rhs', 'amax', 'out', 'amax', 'underflow', 'overflow']
    >>> print(jaxscale.format_precision_stats(stats).split("\\n")[1].split()[-5:])
    ['1', '300', '600', '0.00%', '0.00%']
    """
    if not isinstance(stats, Mapping):
        raise TypeError(
            "format_precision_stats expects the stats dict precision_stats returned, got "
            f"{type(stats).__name__}"
        )
    for key, figures in stats.items():
        if any(is_traced(value) for value in figures.values()):
            raise TypeError(
                f"format_precision_stats needs concrete figures, but {key!r}'s are traced: "
                "return the stats from the jitted function and format them outside it"
            )
    float8 = any("lhs_float8_underflow" in figures for figures in stats.values())
    columns = [
        c
        for c in _COLUMNS
        if float8 or c[0] not in ("lhs_float8_underflow", "rhs_float8_underflow")
    ]

    def cell(figures: Mapping[str, Any], name: str) -> str:
        if name not in figures:
            return "-"
        value = float(figures[name])
        if math.isnan(value):
            return "n/a"
        return f"{100 * value:.2f}%" if name in _FRACTIONS else f"{value:.4g}"

    rows = [["matmul", *[title for _, title in columns]]]
    rows += [[key, *[cell(figures, name) for name, _ in columns]] for key, figures in stats.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(
            [
                row[0].ljust(widths[0]),
                *[c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)],
            ]
        ).rstrip()
        for row in rows
    )


def _report(acc: dict[str, jax.Array], float8: bool) -> dict[str, jax.Array]:
    """The figures of one matmul from its accumulators (and the float8 ones for a matmul
    of float8 operands)."""
    report = {
        "lhs_amax": acc["lhs_amax"],
        "rhs_amax": acc["rhs_amax"],
        "out_amax": acc["out_amax"],
        "underflow": acc["small"] / acc["elements"],
        "overflow": acc["overflow"] / acc["elements"],
    }
    if float8:
        for side in ("lhs", "rhs"):
            report[f"{side}_float8_underflow"] = _fraction(
                acc[f"{side}_cast_lost"], acc[f"{side}_cast_elements"]
            )
    return report
