"""What an accelerator will run, read from a step lowered for it on any machine.

What a jitted function does on a GPU is decided when JAX lowers it: ``jax.export``
lowers for ``cuda``, ``rocm``, ``tpu`` or ``cpu`` on a machine without that device,
and the StableHLO module lists every operation the accelerator will compile. This
module counts, in that text, what makes a step wait for the host or run in a
precision it should not.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

import jax

_DEFINITION = re.compile(r"^\s*(%[\w#:]+)\s*=\s*(\"?[\w.]+\"?)(.*)$")
# the dimensions that lead a tensor type (``4x8x``; none for a scalar): always matches
_DIMENSIONS = re.compile(r"^(?:\d+x)*")
# a tensor type, whose element type may itself have angle brackets (complex<f32>)
_TENSOR = re.compile(r"tensor<((?:[^<>]|<[^<>]*>)*)>")
_SUM = re.compile(r"stablehlo\.reduce\(.*applies stablehlo\.add across dimensions = \[([\d, ]*)\]")
_CUSTOM_CALL = re.compile(r"stablehlo\.custom_call @\"?([^\"(\s]+)\"?\(")
_HOST_OPS = ("stablehlo.send", "stablehlo.recv", "stablehlo.infeed", "stablehlo.outfeed")
_PLATFORMS = ("cuda", "rocm", "tpu", "cpu")
_JITTED = type(jax.jit(lambda: None))


@dataclasses.dataclass(frozen=True)
class LoweringReport:
    """What one lowered program contains.

    Attributes:
      loops: ``while`` loops.
      counted_loops: those among them whose trip count is fixed in the program: a
        counter from a constant, compared with a constant, stepped by a constant (a
        ``lax.fori_loop`` or ``lax.scan`` of static length). XLA finds the trip count,
        and its GPU runtime runs such a loop without reading the predicate back
        (``WhileThunk`` with a known trip count); any other loop reads it back to the
        host on every iteration.
      data_conditionals: conditionals whose predicate is computed from data; each
        one reads it back to the host. Conditionals on a constant (such as
        ``lax.platform_dependent``'s platform index) are folded away by XLA and
        counted in ``constant_conditionals`` instead.
      constant_conditionals: conditionals on a constant.
      host_transfers: host callbacks, sends and receives, infeed and outfeed.
      array_converts: conversions of arrays (not scalars) between dtypes.
      converted_elements: the elements those conversions touch.
      matmul_dtypes: ``{"f16 x f16 -> f16": count, ...}`` over every
        ``dot_general`` and convolution: operand dtypes and result dtype.
      sum_dtypes: ``{"f32": count, ...}`` over every sum that adds more than one
        element into each result (a ``reduce`` with ``add``): the dtype it
        accumulates in. Under autocast a backward pass's sums (a bias's gradient)
        are float32 on an accelerator, as PyTorch's are.
    """

    loops: int
    counted_loops: int
    data_conditionals: int
    constant_conditionals: int
    host_transfers: int
    array_converts: int
    converted_elements: int
    matmul_dtypes: dict[str, int]
    sum_dtypes: dict[str, int]

    @property
    def syncs_with_host(self) -> bool:
        """Whether the program waits for the host: a loop whose trip count is not fixed, a
        conditional on data or a transfer."""
        data_loops = self.loops - self.counted_loops
        return bool(data_loops or self.data_conditionals or self.host_transfers)


def lowering_report(fn: Callable[..., Any], *args: Any, platform: str = "cuda") -> LoweringReport:
    """Lower ``jax.jit(fn)(*args)`` for ``platform`` and report what it will run.

    No device of that platform is needed: ``jax.export`` lowers for it here. Use
    it to check, on a laptop, that a train step will not wait for the host on a GPU
    (no loops, no conditionals on data, no callbacks) and that its matmuls run in
    the dtypes autocast chose.

    Args:
      fn: the function, plain or ``jax.jit``-ed (its static arguments kept). It must
        return what it computes: a step that only updates objects in place (an
        ``nnx.jit`` step returning nothing) lowers to nothing and is refused.
      *args: its arguments (arrays, or ``jax.ShapeDtypeStruct`` for their shapes).
      platform: ``"cuda"``, ``"rocm"``, ``"tpu"`` or ``"cpu"``.

    >>> import jax, jax.numpy as jnp
    >>> import jaxscale
    >>> def step(w, x):
    ...     return jax.grad(lambda w: jnp.sum(jnp.tanh(jaxscale.autocast(jnp.dot)(x, w))))(w)
    >>> report = jaxscale.lowering_report(step, jnp.ones((8, 4)), jnp.ones((2, 8)))
    >>> report.syncs_with_host, report.matmul_dtypes
    (False, {'f16 x f16 -> f16': 2})
    """
    if isinstance(fn, jax.stages.Lowered | jax.stages.Compiled):
        # lowered (or compiled) for this machine's platform, not necessarily ``platform``
        raise TypeError(
            f"lowering_report expects a callable, got a {type(fn).__name__}, which is already "
            f"lowered for one platform: pass the function and its arguments, "
            f"lowering_report(step, *args, platform={platform!r}), and it is lowered for that "
            "platform"
        )
    if not callable(fn):
        raise TypeError(f"lowering_report expects a callable, got {type(fn).__name__} {fn!r}")
    if platform not in _PLATFORMS:
        raise ValueError(f"platform must be one of {', '.join(_PLATFORMS)}; got {platform!r}")
    # jax.export takes what jax.jit returns; anything else is jitted here, as a nested call.
    jitted: Any = fn if isinstance(fn, _JITTED) else jax.jit(fn)
    exported = _export(jitted, platform, args)
    if not exported.out_avals:
        raise ValueError(
            f"{getattr(fn, '__name__', 'fn')} returns no arrays, so everything it computes is "
            "dead code and lowers to nothing: return the step's results (for Flax NNX, "
            "split the objects and return nnx.state of them, as examples/gpu_lowering.py does)"
        )
    return analyse_stablehlo(exported.mlir_module())


def _export(jitted: Any, platform: str, args: tuple[Any, ...]) -> Any:
    """``jax.export`` of ``jitted`` for ``platform``. Export refuses a module with custom
    calls that JAX does not promise to keep stable (a fused kernel, a foreign function);
    the report reads the module and keeps nothing, so those calls are allowed by name."""
    try:
        return jax.export.export(jitted, platforms=[platform])(*args)
    except ValueError:
        module = jitted.trace(*args).lower(lowering_platforms=(platform,)).as_text()
        targets = sorted(set(_CUSTOM_CALL.findall(module)))
        if not targets:
            raise
        allowed = [jax.export.DisabledSafetyCheck.custom_call(t) for t in targets]
        return jax.export.export(jitted, platforms=[platform], disabled_checks=allowed)(*args)


def analyse_stablehlo(module: str) -> LoweringReport:
    """Count what :class:`LoweringReport` holds in a StableHLO module's text."""
    constants: set[str] = set()
    loops = counted = data_cases = constant_cases = host = converts = converted = 0
    matmuls: collections.Counter[str] = collections.Counter()
    sums: collections.Counter[str] = collections.Counter()
    lines = module.splitlines()
    for number, line in enumerate(lines):
        match = _DEFINITION.match(line)
        if match:
            name, op = match.group(1).split(":")[0], match.group(2).strip('"')
            if op == "stablehlo.constant" or (
                op == "stablehlo.case" and _is_constant_case(lines, number, constants)
            ):
                constants.add(name)
        if "stablehlo.while" in line:
            loops += 1
            counted += _is_counted_loop(lines, number, constants)
        if '"stablehlo.case"' in line or '"stablehlo.if"' in line or "stablehlo.if " in line:
            operand = re.search(r"\((%[\w#]+)\)", line)
            if operand and operand.group(1) in constants:
                constant_cases += 1
            else:
                data_cases += 1
        if any(op in line for op in _HOST_OPS) or (
            "custom_call" in line and "callback" in line.lower()
        ):
            host += 1
        if "stablehlo.convert" in line:
            tensors = _TENSOR.findall(line)
            if tensors and _elements(tensors[0]) > 1:
                converts += 1
                converted += _elements(tensors[0])
        if "stablehlo.dot_general" in line or "stablehlo.convolution" in line:
            tensors = _TENSOR.findall(line)
            if tensors:
                kinds = [_element_type(t) for t in tensors]
                matmuls[" x ".join(kinds[:2]) + " -> " + kinds[-1]] += 1
        summed = _SUM.search(line)
        if summed:
            operand = _TENSOR.findall(line)[0]
            sizes = _dimensions(operand)
            axes = [int(a) for a in summed.group(1).split(",") if a.strip()]
            if math.prod(sizes[a] for a in axes) > 1:
                sums[_element_type(operand)] += 1
    return LoweringReport(
        loops, counted, data_cases, constant_cases, host, converts, converted,
        dict(matmuls), dict(sums),
    )  # fmt: skip


_LOOP_CARRY = re.compile(r"(%iterArg\w*) = (%[\w#]+)")
_COMPARE = re.compile(r"stablehlo\.compare\s+(\w+),\s*(%[\w#]+),\s*(%[\w#]+)")
_STEP = re.compile(r"stablehlo\.add\s+(%[\w#]+),\s*(%[\w#]+)")


def _is_counted_loop(lines: list[str], start: int, constants: set[str]) -> bool:
    """Whether the ``while`` at ``lines[start]`` counts from a constant to a constant by a
    constant: its condition one comparison of a carried counter with a constant, the
    counter starting at a constant and its body adding a constant to it."""
    starts = dict(_LOOP_CARRY.findall(lines[start]))
    condition: list[str] = []
    body: list[str] = []
    region = None
    depth = 0
    for line in lines[start + 1 :]:
        stripped = line.strip()
        if region is None and stripped == "cond {":
            region = condition
            continue
        if stripped == "} do {" and depth == 0:
            region = body
            continue
        if region is body and stripped.startswith("}") and depth == 0:
            break
        depth += line.count("{") - line.count("}")
        if region is not None:
            region.append(stripped)
    compares = [match for line in condition for match in _COMPARE.findall(line)]
    if len(compares) != 1 or len([ln for ln in condition if "stablehlo." in ln]) != 2:
        return False
    _, left, right = compares[0]
    counter, bound = (left, right) if left in starts else (right, left)
    if counter not in starts or starts[counter] not in constants or bound not in constants:
        return False
    return any(
        counter in (a, b) and (b if a == counter else a) in constants
        for line in body
        for a, b in _STEP.findall(line)
    )


def _dimensions(tensor: str) -> list[int]:
    """``4x8xf16`` -> [4, 8]; ``complex<f32>`` -> []."""
    return [int(d) for d in re.findall(r"(\d+)x", tensor[: _DIMENSIONS.match(tensor).end()])]  # type: ignore[union-attr]


def _element_type(tensor: str) -> str:
    """``4x8xf16`` -> ``f16``; ``4xcomplex<f32>`` -> ``complex<f32>``."""
    return tensor[_DIMENSIONS.match(tensor).end() :]  # type: ignore[union-attr]


def _elements(tensor: str) -> int:
    return math.prod(_dimensions(tensor))


def _is_constant_case(lines: list[str], start: int, constants: set[str]) -> bool:
    """A case on a constant whose every branch returns a constant is itself a constant."""
    operand = re.search(r"\((%[\w#]+)\)", lines[start])
    if not operand or operand.group(1) not in constants:
        return False
    returns = []
    for line in lines[start:]:
        if "stablehlo.return" in line:
            returns += re.findall(r"(%[\w#]+)", line.split("stablehlo.return", 1)[1])
        if line.strip().startswith("}) :"):
            break
    return bool(returns) and all(r in constants for r in returns)
