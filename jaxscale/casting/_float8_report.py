"""Which matmuls a float8 recipe harms: each one measured, and a filter proposed.

:func:`float8_report` runs a loss function once in float32. Each matmul the recipe
could take is computed there in float32, and beside it in the recipe on the same
operands: its output, and, on the same output gradient, its two operands' gradients.
So each matmul's error is its own, not the sum of the errors of the layers before it.
The figures leave the step through the gradient of a zero "probe" per matmul (its
backward pass returns them), so one ``jax.grad`` measures the forward and backward
matmuls of every layer, inside scans too: a matmul in the body of a scan over stacked
layers has a probe row per layer, indexed by the iteration (in scans nested in scans,
one row for all iterations).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxscale._src.explicit_axes import foreign_mesh, replicated_here
from jaxscale._src.jaxprs import dot_dimension_numbers
from jaxscale._src.stateful_call import TracedCall
from jaxscale.casting._autocast import _check_key, _validated_dtype
from jaxscale.casting._float8_matmul import (
    as_rows_and_columns,
    float8_dot_general,
    forward_operands,
    no_cotangent,
    recipe_for,
)
from jaxscale.casting._interpreter import Autocaster, Tag, weight_on_the_left
from jaxscale.casting._matmul_site import MatmulSite
from jaxscale.casting._state_writes import state_writes_marked

# the sums each matmul's probe collects: squared error and squared reference of the
# output, the input's gradient and the weight's; the forward operands' values flushed to
# zero, saturated, and not zero to begin with; how many times it ran
_STATS = 10


@dataclasses.dataclass(frozen=True)
class MatmulError:
    """One matmul under a float8 recipe, against float32 on the same operands.

    Attributes:
      site: the matmul, as a ``float8_filter`` sees it; in a scan over stacked layers,
        one layer's (``site.layer``), each layer measured apart (in scans nested in
        scans, ``site.layer`` is ``None``: the figures are over every iteration).
      output, input_grad, weight_grad: relative L2 error (``||recipe - f32|| / ||f32||``)
        of its output and of its two operands' gradients (the weight is the operand
        :attr:`MatmulSite.weight` names, else the right one).
      flushed, saturated: of the forward operands' nonzero values, the fraction the
        recipe's quantization turned to zero, and the fraction it clipped (stored more
        than one step of the format below their magnitude).
      flops: the matmul's share of the step's matmul FLOPs (its forward and two
        backward matmuls; in nested scans, every iteration; all ``dot_general``\\ s
        counted).
      ran: whether the step ran it: a matmul in a ``lax.cond`` branch the step did not
        take was not measured, and its figures are zeros.
    """

    site: MatmulSite
    output: float
    input_grad: float
    weight_grad: float
    flushed: float
    saturated: float
    flops: float
    ran: bool = True

    @property
    def error(self) -> float:
        """The largest of the three relative errors: what the proposal ranks by."""
        return max(self.output, self.input_grad, self.weight_grad)

    @staticmethod
    def sqnr_db(relative_error: float) -> float:
        """Signal-to-quantization-noise ratio of a relative L2 error, in dB."""
        return math.inf if relative_error == 0 else -20.0 * math.log10(relative_error)


@dataclasses.dataclass(frozen=True)
class Float8Report:
    """What :func:`float8_report` measured, and the filter it proposes.

    Attributes:
      recipe: the recipe's name.
      matmuls: one :class:`MatmulError` per matmul the recipe could take, in the order
        traced.
      bound: the largest relative error the proposal lets a float8 matmul keep.
      kept: the matmuls the proposal keeps in the autocast dtype: the largest errors,
        one at a time, until every other matmul's is at most ``bound`` (or the FLOPs
        kept would exceed ``keep_at_most``).
      unmeasured: the matmuls the recipe could take inside a ``jax.custom_vjp`` or
        ``jax.custom_jvp`` (the steps of a Diffrax solve, say), whose gradients the
        user's rule computes where the report cannot measure them; autocast runs them
        in the recipe, and the proposal's filter takes them.
      unmeasured_flops: their share of the step's matmul FLOPs.
    """

    recipe: str
    matmuls: tuple[MatmulError, ...]
    bound: float
    kept: tuple[MatmulError, ...]
    unmeasured: tuple[MatmulSite, ...] = ()
    unmeasured_flops: float = 0.0

    @property
    def float8_flops(self) -> float:
        """The share of the step's matmul FLOPs the proposal runs in the recipe (the
        :attr:`unmeasured` matmuls' among them)."""
        chosen = {id(m) for m in self.kept}
        measured = sum(m.flops for m in self.matmuls if id(m) not in chosen)
        return measured + self.unmeasured_flops

    def proposed_filter(self) -> Callable[[MatmulSite], bool]:
        """A ``float8_filter`` refusing the :attr:`kept` matmuls (matched by name stack,
        weight path, source line, shapes and, in a scan over layers, the layer) and
        taking every other."""
        refused = {_identity(m.site) for m in self.kept}

        def keep(site: MatmulSite) -> bool:
            # a matmul measured over all its layers at once (in nested scans) is refused
            # in every layer
            every_layer = replace(site, layer=None)
            return _identity(site) not in refused and _identity(every_layer) not in refused

        keep.__qualname__ = f"float8_report.proposed_filter({len(refused)} kept)"
        return keep

    def table(self) -> str:
        """The figures as a text table, one matmul a row: errors as percentages and
        SQNR in dB, the fractions and the FLOPs share as percentages, and whether the
        proposal keeps it in the autocast dtype."""
        rows = [["matmul", "shape MxKxN", "out err", "SQNR", "dgrad err", "wgrad err",
                 "flushed", "saturated", "FLOPs", "proposal"]]  # fmt: skip
        chosen = {id(m) for m in self.kept}
        for m in self.matmuls:
            figures = [
                f"{100 * m.output:.2f}%", f"{MatmulError.sqnr_db(m.output):.1f} dB",
                f"{100 * m.input_grad:.2f}%", f"{100 * m.weight_grad:.2f}%",
                f"{100 * m.flushed:.2f}%", f"{100 * m.saturated:.2f}%",
            ] if m.ran else ["not run"] * 6  # fmt: skip
            rows.append([
                _label(m.site), "x".join(str(d) for d in m.site.dims), *figures,
                f"{100 * m.flops:.1f}%", "keep" if id(m) in chosen else self.recipe,
            ])  # fmt: skip
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = [
            "  ".join([row[0].ljust(widths[0]), *[c.rjust(w) for c, w in
                                                 zip(row[1:], widths[1:], strict=True)]])
            for row in rows
        ]  # fmt: skip
        lines.append(
            f"proposal: {len(self.kept)} of {len(self.matmuls)} matmuls kept, "
            f"{100 * self.float8_flops:.1f}% of matmul FLOPs in {self.recipe}; bound "
            f"{100 * self.bound:.2f}%"
        )
        if self.unmeasured:
            lines.append(
                f"not measured: {len(self.unmeasured)} matmuls inside a custom_vjp or "
                f"custom_jvp, {100 * self.unmeasured_flops:.1f}% of matmul FLOPs, in "
                f"{self.recipe}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _identity(site: MatmulSite) -> tuple[Any, ...]:
    return (site.name_stack, site.weight, site.source, site.shapes, site.layer)


def _label(site: MatmulSite) -> str:
    label = site.weight or site.name_stack or site.source or f"matmul {site.index}"
    return label if site.layer is None else f"{label} layer {site.layer}"


def float8_report(
    fn: Callable[..., Any],
    *args: Any,
    dtype: Any = jnp.bfloat16,
    recipe: Any = "rowwise",
    bound: float = 0.1,
    keep_at_most: float = 1.0,
    key: Any = None,
    **kwargs: Any,
) -> Float8Report:
    """Measure each matmul of ``fn(*args, **kwargs)`` (a scalar loss) under a float8
    recipe, and propose which to keep in ``dtype``.

    The function runs once in float32. Every matmul ``autocast(fn, dtype=dtype,
    float8=recipe)`` would run in the recipe is computed in float32 and, on the same
    operands, in the recipe; in the backward pass both are given the float32 output
    gradient. The relative L2 errors of the output and of both operands' gradients are
    each matmul's own (see :class:`MatmulError`). The proposal keeps the matmuls of
    largest error in ``dtype``, one at a time, until every other is at most ``bound``
    (:attr:`Float8Report.kept`); pass :meth:`Float8Report.proposed_filter` to
    ``autocast(..., float8_filter=...)``.

    Args:
      fn: a function returning a scalar loss, as ``autocast`` takes it (a module, a
        plain function of parameters and data).
      *args: its positional arguments.
      **kwargs: its keyword arguments.
      dtype: the autocast dtype the recipes compute in.
      recipe: as ``autocast``'s ``float8``.
      bound: the largest relative error left in float8 (0.1 is 10%).
      keep_at_most: the largest share of the step's matmul FLOPs the proposal keeps in
        ``dtype`` (NVIDIA's NVFP4 recipe keeps about 15% of linear layers): a matmul
        that would exceed it is left to the recipe, and the next one is considered.
      key: for a recipe that rounds stochastically, as ``autocast``'s.

    Example:
      >>> import jax, jax.numpy as jnp, jaxscale
      >>> ws = {"body": jnp.ones((64, 64)) / 8, "head": jnp.eye(64, 32) * 1e-3}
      >>> def loss(ws, x):
      ...     return jnp.mean((jnp.tanh(x @ ws["body"]) @ ws["head"]) ** 2)
      >>> x = jax.random.normal(jax.random.key(0), (32, 64))
      >>> report = jaxscale.float8_report(loss, ws, x, recipe="rowwise")
      >>> [m.site.weight for m in report.matmuls]
      ["[0]['body']", "[0]['head']"]
    """
    resolved = recipe_for(recipe)
    if resolved is None:
        raise ValueError("float8_report measures a float8 recipe: pass recipe='rowwise' or another")
    compute_dtype = _validated_dtype(dtype)
    _check_key(key, resolved)
    if isinstance(bound, bool) or not (isinstance(bound, (int, float)) and bound >= 0):
        raise ValueError(f"bound must be a relative error >= 0, e.g. 0.1, got {bound!r}")
    if isinstance(keep_at_most, bool) or not (
        isinstance(keep_at_most, (int, float)) and 0 <= keep_at_most <= 1
    ):
        raise ValueError(
            f"keep_at_most must be a share of FLOPs in [0, 1], e.g. 0.15, got {keep_at_most!r}"
        )

    sites: list[tuple[MatmulSite, float]] = []
    rows: list[tuple[int, int | None]] = []  # each matmul's first row, and its layers
    other_flops = [0.0]
    # float8 matmuls inside a custom_vjp or custom_jvp, whose gradients its rule computes
    unmeasured: list[tuple[MatmulSite, float]] = []
    with state_writes_marked():
        call = TracedCall(fn, args, kwargs)

    def measure(probes: jax.Array | None, inputs: list[Any]) -> Any:
        # the arguments enter as the jitted function's own: XLA would fold the
        # quantization of constants, and its folding of the subnormal scales of MX's
        # all-zero blocks differs from what the compiled program computes
        autocaster = Autocaster(np.float32, resolved)
        autocaster.per_iteration = True
        recording = probes is None
        autocaster.matmul_hook = _hook(
            resolved, compute_dtype, key, probes, sites if recording else None, rows,
            other_flops, unmeasured,
        )  # fmt: skip
        autocaster.name_inputs(inputs, call.input_paths)
        return autocaster.run(call.closed, inputs, [Tag.GIVEN] * len(inputs))[0]

    loss_shape = jax.eval_shape(lambda inputs: measure(None, inputs), call.inputs)
    if getattr(loss_shape, "shape", None) != () or not jnp.issubdtype(
        loss_shape.dtype, jnp.floating
    ):
        raise TypeError(
            f"float8_report needs fn to return a scalar floating loss, got {loss_shape}"
        )
    inside_rules = _rule_sites_text([site for site, _ in unmeasured])
    if not sites:
        if unmeasured:
            raise ValueError(
                f"float8_report cannot measure fn's float8 matmuls {inside_rules}; measure "
                "the function the rule calls instead (a solver's vector field, say, on "
                "representative inputs)"
            )
        raise ValueError(
            f"fn has no matmul the {getattr(resolved, 'name', resolved)!r} recipe could take "
            "(a 2-D dot_general whose sizes are multiples of 16, or of an MX block)"
        )
    if unmeasured:
        warnings.warn(
            f"float8_report leaves out of its table and proposal the float8 matmuls {inside_rules}",
            stacklevel=2,
        )
    zeros = jnp.zeros((len(sites), _STATS), jnp.float32)
    gradient = jax.jit(jax.grad(lambda p, inputs: measure(p, inputs).astype(jnp.float32)))
    sums = np.asarray(gradient(zeros, call.inputs), np.float64)
    total = sum(f for _, f in sites) + sum(f for _, f in unmeasured) + other_flops[0]
    matmuls = tuple(
        MatmulError(
            site=site,
            output=_relative(row[0], row[1]),
            input_grad=_relative(row[2], row[3]),
            weight_grad=_relative(row[4], row[5]),
            flushed=float(row[6] / row[8]) if row[8] else 0.0,
            saturated=float(row[7] / row[8]) if row[8] else 0.0,
            flops=flops / total if total else 0.0,
            ran=bool(row[9] > 0),
        )
        for (site, flops), row in zip(sites, sums, strict=True)
    )
    kept: list[MatmulError] = []
    kept_flops = 0.0
    for matmul in sorted(matmuls, key=lambda m: m.error, reverse=True):
        if matmul.error <= bound:
            break
        if kept_flops + matmul.flops <= keep_at_most + 1e-9:
            kept.append(matmul)
            kept_flops += matmul.flops
    kept_ids = {id(m) for m in kept}
    return Float8Report(
        recipe=getattr(resolved, "name", str(recipe)),
        matmuls=matmuls,
        bound=float(bound),
        kept=tuple(m for m in matmuls if id(m) in kept_ids),
        unmeasured=tuple(site for site, _ in unmeasured),
        unmeasured_flops=sum(f for _, f in unmeasured) / total if total else 0.0,
    )


def _rule_sites_text(unmeasured: list[MatmulSite]) -> str:
    """The matmuls inside ``jax.custom_vjp`` rules, and why they are not measured."""
    labels = sorted({_label(site) for site in unmeasured})
    shown = ", ".join(labels[:4]) + (f" and {len(labels) - 4} more" if len(labels) > 4 else "")
    return (
        f"{shown} (inside a jax.custom_vjp or jax.custom_jvp, as the steps of a Diffrax "
        "solve or an Equinox checkpointed loop are: the user's rule computes their "
        "gradients, where the report's probes cannot reach; autocast still runs them in "
        "the recipe)"
    )


def _relative(error: float, reference: float) -> float:
    if reference == 0:
        return 0.0 if error == 0 else math.inf
    return float(math.sqrt(error / reference))


def _hook(
    recipe: Any,
    dtype: np.dtype,
    key: Any,
    probes: jax.Array | None,
    sites: list[tuple[MatmulSite, float]] | None,
    rows: list[tuple[int, int | None]],
    other_flops: list[float],
    unmeasured: list[tuple[MatmulSite, float]],
) -> Any:
    """The matmul hook of one pass: the first (no probes) records the sites, their
    FLOPs and their probe rows; the second measures each site into its probe's
    gradient. A matmul in the body of a scan over layers (one scan, not nested in
    another) gets a row per layer, one site per layer; in nested scans, one row for
    all its iterations."""
    count = [0]

    def hook(autocaster: Autocaster, eqn: Any, invals: list[Any]) -> Any:
        lhs, rhs = invals
        dims = dot_dimension_numbers(eqn)
        if autocaster.shape_pass:  # (traced for its types alone: nothing to count)
            return _reference(lhs, rhs, dims) if autocaster.runs_in_float8(eqn) else None
        if not autocaster.runs_in_float8(eqn):
            if sites is not None:
                other_flops[0] += _batched_flops(lhs.shape, rhs.shape, dims) * autocaster.repeats
            return None
        if autocaster.custom_rule_depth:
            # within a jax.custom_vjp or jax.custom_jvp: its rule computes the gradients,
            # and a probe of the report's would be a value the rule closes over
            if sites is not None:
                flops = _batched_flops(lhs.shape, rhs.shape, dims) * autocaster.repeats
                unmeasured.append((autocaster.site(eqn, invals), flops))
            return _reference(lhs, rhs, dims)
        autocaster.site_count += 1
        index = count[0]
        count[0] += 1
        site = autocaster.site(eqn, invals)
        if sites is not None:  # forward and two backward matmuls, each iteration of a scan
            m, k, n = site.dims
            flops = 3 * 2.0 * m * k * n
            layers = site.layers
            if autocaster.iteration is not None and layers == autocaster.repeats:
                rows.append((len(sites), layers))
                sites.extend((replace(site, layer=i), flops) for i in range(layers))
            else:
                rows.append((len(sites), None))
                sites.append((replace(site, layer=None, layers=None), flops * autocaster.repeats))
        if probes is None or index >= len(rows):
            return _reference(lhs, rhs, dims)
        row, layers = rows[index]
        # (the probes, a scan's iteration and the key, typed for a matmul computed with
        # explicit mesh axes made automatic)
        here, iteration, own_key = (
            value if value is None or foreign_mesh(value) is None else replicated_here(value)
            for value in (probes, autocaster.iteration, key)
        )
        site_key = None if own_key is None else jax.random.fold_in(own_key, index)
        if site_key is not None and layers is not None:  # each layer draws its own, as autocast's
            site_key = jax.random.fold_in(site_key, iteration)
        probe = here[row] if layers is None else here[row + iteration]
        on_the_left = weight_on_the_left(autocaster.origin_of(lhs), autocaster.origin_of(rhs))
        return _measured(lhs, rhs, probe, dims, recipe, dtype, site_key, on_the_left)

    return hook


def _batched_flops(lhs_shape: Any, rhs_shape: Any, dims: Any) -> float:
    """Forward and two backward FLOPs of any ``dot_general``."""
    (lhs_contract, _), (lhs_batch, _) = dims
    rhs_size = float(np.prod(rhs_shape))
    shared = float(np.prod([lhs_shape[d] for d in (*lhs_contract, *lhs_batch)]))
    return 3 * 2.0 * float(np.prod(lhs_shape)) * rhs_size / max(shared, 1.0)


def _reference(lhs: jax.Array, rhs: jax.Array, dims: Any) -> jax.Array:
    return lax.dot_general(
        lhs.astype(jnp.float32), rhs.astype(jnp.float32), dims,
        precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32,
    )  # fmt: skip


def _squares(ours: jax.Array, reference: jax.Array) -> tuple[jax.Array, jax.Array]:
    ours = ours.astype(jnp.float32)
    return jnp.sum(jnp.square(ours - reference)), jnp.sum(jnp.square(reference))


def _measured(lhs: jax.Array, rhs: jax.Array, probe: jax.Array, dims: Any, recipe: Any,
              dtype: np.dtype, key: Any, weight_on_left: bool) -> jax.Array:  # fmt: skip
    """The float32 product of ``lhs`` and ``rhs``, whose backward pass writes the
    recipe's errors on this matmul into ``probe``'s gradient."""

    def in_recipe(a: jax.Array, b: jax.Array, key: Any) -> jax.Array:
        return float8_dot_general(a.astype(dtype), b, dims, recipe, dtype, key)

    def operand_counts(a: jax.Array, b: jax.Array) -> jax.Array:
        lhs_perm, rhs_perm, m, k, n = as_rows_and_columns(dims, a.shape, b.shape)
        x = jnp.transpose(a, lhs_perm).reshape(m, k).astype(dtype)
        w_t = jnp.transpose(b, rhs_perm).reshape(k, n)
        x_seen, w_seen, bits = forward_operands(x, w_t, recipe, dtype)
        counts = []
        for value, seen, axis in ((x, x_seen, 1), (w_t, w_seen, 0)):
            value = value.astype(jnp.float32)
            nonzero = value != 0
            flushed = nonzero & (seen == 0)
            # clipped: stored more than a step of the format below its magnitude, and
            # among the largest of its 16 values along K (a value rounded among the
            # format's subnormals loses more than a step too, but is small)
            magnitude = jnp.abs(value)
            chunks = jnp.moveaxis(magnitude, axis, -1)
            chunk_max = jnp.max(chunks.reshape(*chunks.shape[:-1], -1, 16), axis=-1)
            near_top = jnp.moveaxis(jnp.repeat(chunk_max, 16, axis=-1), -1, axis) * 0.5
            clipped = (magnitude > jnp.abs(seen) * (1.0 + 2.0**-bits)) & (magnitude >= near_top)
            counts.append(jnp.stack([jnp.sum(flushed), jnp.sum(clipped), jnp.sum(nonzero)]))
        return jnp.sum(jnp.stack(counts), axis=0).astype(jnp.float32)

    # the key is an argument, not a closure: drawn inside a scan's body (a layer's own
    # key), it is a value of that body's trace, which the backward rule is traced outside
    @jax.custom_vjp
    def product(a: jax.Array, b: jax.Array, probe: jax.Array, key: Any) -> jax.Array:
        return _reference(a, b, dims)

    def forward(a: jax.Array, b: jax.Array, probe: jax.Array,
                key: Any) -> tuple[jax.Array, Any]:  # fmt: skip
        reference = _reference(a, b, dims)
        output_error = jnp.stack(_squares(in_recipe(a, b, key), reference))
        return reference, (a, b, key, output_error, operand_counts(a, b))

    def backward(saved: Any, grad: jax.Array) -> tuple[Any, Any, Any, Any]:
        a, b, key, output_error, counts = saved
        grad_a, grad_b = jax.vjp(lambda a, b: _reference(a, b, dims), a, b)[1](grad)
        ours_a, ours_b = jax.vjp(lambda a, b: in_recipe(a, b, key), a, b)[1](grad.astype(dtype))
        a_error = jnp.stack(_squares(ours_a, grad_a.astype(jnp.float32)))
        b_error = jnp.stack(_squares(ours_b, grad_b.astype(jnp.float32)))
        weight, other = (a_error, b_error) if weight_on_left else (b_error, a_error)
        figures = jnp.concatenate([output_error, other, weight, counts, jnp.ones(1)])
        return grad_a.astype(a.dtype), grad_b.astype(b.dtype), figures, no_cotangent(key)

    product.defvjp(forward, backward)
    return product(lhs, rhs, probe, key)
