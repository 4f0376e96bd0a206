"""``autocast``: PyTorch's ``torch.autocast`` as a JAX function transform."""

from __future__ import annotations

import functools
import typing
from collections.abc import Callable
from typing import Any, TypeVar, overload

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale._src import validation
from jaxscale._src.stateful_call import TracedCall
from jaxscale.casting import _higher_order  # noqa: F401  (registers the higher-order rules)
from jaxscale.casting._float8_matmul import recipe_for, rounds_stochastically
from jaxscale.casting._hidden_state import refuse_inside_hidden_state
from jaxscale.casting._interpreter import MARKER, Autocaster, Tag, cast_floating
from jaxscale.casting._matmul_site import LayerFilter
from jaxscale.casting._nvfp4_matmul import NVFP4Recipe
from jaxscale.casting._policy import validated_device_type
from jaxscale.casting._region import DEFAULT_DTYPES, autocast_state
from jaxscale.casting._state_writes import state_writes_marked

F = TypeVar("F", bound=Callable[..., Any])
_DTYPES = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))


@overload
def autocast(
    fn: F,
    *,
    device_type: str = ...,
    dtype: Any = ...,
    enabled: bool = ...,
    float8: Any = ...,
    grad_dtype: Any = ...,
    float8_filter: Any = ...,
    key: Any = ...,
) -> F: ...
@overload
def autocast(
    fn: None = None,
    *,
    device_type: str = ...,
    dtype: Any = ...,
    enabled: bool = ...,
    float8: Any = ...,
    grad_dtype: Any = ...,
    float8_filter: Any = ...,
    key: Any = ...,
) -> Callable[[F], F]: ...


def autocast(
    fn: Callable[..., Any] | None = None,
    *,
    device_type: str = "cuda",
    dtype: Any = None,
    enabled: bool = True,
    float8: Any = None,
    grad_dtype: Any = None,
    float8_filter: Any = None,
    key: Any = None,
) -> Any:
    """Run ``fn`` with PyTorch's autocast policy: ``with torch.autocast("cuda"):``, or
    ``with torch.autocast("cpu"):`` with ``device_type="cpu"``.

    ``autocast(fn)`` returns a function that computes what ``fn`` computes, with
    each operation in the precision PyTorch's autocast gives it:

    * matmuls and convolutions (``dot_general``, ``conv_general_dilated``: ``@``,
      ``einsum``, ``nnx.Linear``, ``nnx.Conv``, attention) run in ``dtype``, and a
      bias added to their output stays in ``dtype``, as PyTorch's ``linear`` and
      ``conv`` include their bias;
    * exponentials, logarithms, powers, ``rsqrt``, sums and products run in
      float32, so softmax, log-softmax, layer and group norm, cross entropy and
      MSE give float32 results;
    * everything else runs in its inputs' dtype, the widest when they differ (a
      scalar does not widen an array).

    The table is :data:`jaxscale.casting.POLICY`. ``device_type="cpu"`` takes
    PyTorch's CPU lists instead (:data:`jaxscale.casting.CPU_POLICY`, bfloat16 by
    default): the same matmuls and convolutions in ``dtype``, but exponentials,
    logarithms, powers, sums, softmax and norms in their inputs' dtype, and ``prod``,
    linear algebra and fft in float32. The policy is the device type's, not where the
    code runs: either runs on any JAX backend. Integer, boolean and key values
    are never cast, and parameters keep their dtype: the casts are inside the
    computation, so gradients come back in the parameters' dtype, and the
    backward matmuls run in ``dtype`` too. ``fn`` is traced once per call to a
    jaxpr and evaluated anew with the casts (inside ``jit`` this happens while
    tracing: it compiles once and costs nothing at run time). It reaches inside
    nested ``jit``, ``scan`` (and ``nnx.scan``), ``while_loop``/``fori_loop``,
    ``cond``/``switch``, ``checkpoint`` (``nnx.remat``), ``custom_jvp`` and
    ``custom_vjp`` (whose rules are kept) and ``shard_map``; a higher-order
    primitive it does not know raises ``NotImplementedError`` naming it.

    ``fn`` may be any callable: a function, a Flax NNX module
    (``autocast(model)(x)``) or a bound method. NNX state the call writes
    (BatchNorm statistics, RNG counters) lands in the module as without
    autocast, in the module's dtypes. ``autocast(g, enabled=False)`` called
    inside an autocast function runs ``g`` as traced, without casts: PyTorch's
    nested ``with autocast(enabled=False):``.

    Args:
      fn: the function to transform; omit it to get a decorator.
      device_type: ``"cuda"`` (the default) or ``"cpu"``: whose autocast lists to follow.
      dtype: ``jnp.float16`` or ``jnp.bfloat16``; ``None`` (the default) is the device
        type's default, as in PyTorch: float16 for ``"cuda"``, bfloat16 for ``"cpu"``.
      enabled: if False, ``fn`` runs as written.
      float8: ``None`` (the default), or torchao's float8 training recipe for the
        matmuls of linear layers: ``"tensorwise"``, ``"rowwise"``,
        ``"rowwise_with_gw_hp"`` or a :class:`jaxscale.casting.Float8Recipe`. Every
        ``dot_general`` without batch dimensions whose rows, contracted size and
        columns are multiples of 16 then runs its forward matmul and both backward
        matmuls on float8 operands with dynamic scales, as torchao's
        ``Float8Linear`` does; everything else follows ``dtype``. ``"mxfp8"`` and
        ``"mxfp8_wgrad_with_hp"`` (or a :class:`jaxscale.casting.MXRecipe`) are torchao's
        MXFP8 recipes (``MXFP8Linear`` with ``KernelPreference.EMULATED``): every operand
        of the three matmuls in MXFP8, blocked by 32 along that matmul's contracting
        dimension (:func:`jaxscale.quantize_mx`, RCEIL scales), dequantized to ``dtype``
        and multiplied there, for matmuls whose three sizes are multiples of 32.
        ``"nvfp4"`` (or a :class:`jaxscale.casting.NVFP4Recipe`) is NVIDIA's NVFP4
        training recipe, emulated the same way: TransformerEngine's scale chain, the
        weight in 16x16 tiles, the output gradient rounded stochastically, the weight
        gradient's operands through the random Hadamard transform, for matmuls whose
        three sizes are multiples of 16.
      grad_dtype: ``None`` (the default), or ``jnp.float32``: the gradient of a
        float32 value that autocast narrows for a matmul (a parameter, an input)
        comes out of the backward matmul in float32, computed from the same
        half-precision operands (``preferred_element_type=float32``), and is never
        rounded to ``dtype`` on its way back (FSDP's ``reduce_dtype=torch.float32``;
        data-parallel all-reduces then sum float32). It applies to ``dot_general``
        outside the float8 recipes' linear layers, and makes those matmuls
        reverse-mode only (a ``custom_vjp``): ``jax.jvp`` of them is an error.
      float8_filter: ``None`` (every eligible matmul), or a function of a
        :class:`jaxscale.casting.MatmulSite` that says whether that matmul runs in the
        ``float8`` recipe (its forward and both backward matmuls together); a refused
        matmul runs as ``dtype`` says. :func:`jaxscale.casting.exclude_names` and
        :func:`jaxscale.casting.keep_layers` build the common ones.
      key: a PRNG key for the recipes that round stochastically (``"nvfp4"``'s output
        gradients; a :class:`jaxscale.casting.Float8Recipe` or ``MXRecipe`` with
        ``stochastic_gradients=True``): give each step its own, e.g.
        ``jax.random.fold_in(key, step)``. Each matmul folds in its own index.

    Returns:
      The transformed function, or a decorator when ``fn`` is omitted.

    Raises:
      ValueError: for a ``dtype`` other than float16 or bfloat16, a ``device_type``
        other than ``"cuda"`` or ``"cpu"``, or an unknown ``float8`` recipe.
      TypeError: for a ``fn`` that is not callable (a string: PyTorch's
        ``torch.autocast("cpu")`` is ``autocast(fn, device_type="cpu")``), or a
        ``dtype`` that is no dtype.

    >>> import jax.numpy as jnp, jaxscale
    >>> def layer(w, x):
    ...     return jnp.tanh(x @ w), jnp.sum(x @ w)
    >>> out, total = jaxscale.autocast(layer)(jnp.ones((4, 4)), jnp.ones((2, 4)))
    >>> out.dtype, total.dtype
    (dtype('float16'), dtype('float32'))
    >>> @jaxscale.autocast(dtype=jnp.bfloat16)
    ... def project(w, x):
    ...     return x @ w
    >>> project(jnp.ones((4, 4)), jnp.ones((2, 4))).dtype
    dtype(bfloat16)
    >>> jaxscale.autocast(lambda x: jnp.exp(x @ x), device_type="cpu")(jnp.ones((2, 2))).dtype
    dtype(bfloat16)
    """
    device_type = validated_device_type(device_type)
    dtype = DEFAULT_DTYPES[device_type] if dtype is None else _validated_dtype(dtype)
    validation.as_bool("enabled", enabled)
    recipe = recipe_for(float8)
    gradients = _validated_grad_dtype(grad_dtype)
    site_filter = _validated_filter(float8_filter, recipe)
    _check_key(key, recipe)
    if fn is None:
        return _Decorator(device_type, dtype, enabled, recipe, gradients, site_filter, key)
    if isinstance(fn, str):
        if fn in ("cuda", "cpu", "xpu", "mps", "hpu", "xla"):
            raise TypeError(
                f"autocast's first argument is the function to transform, got {fn!r}: "
                f'PyTorch\'s torch.autocast("{fn}") is jaxscale.autocast(fn, '
                f'device_type="{fn}"), or @jaxscale.autocast(device_type="{fn}") on the function'
            )
        raise TypeError(
            f"autocast's first argument is the function to transform, got the string {fn!r}: "
            "pass the function itself, jaxscale.autocast(loss_fn)"
        )
    if _is_a_dtype(fn):
        name = np.dtype(typing.cast(Any, fn)).name
        raise TypeError(
            f"autocast's first argument is the function to transform, got the dtype {name}: "
            f"write jaxscale.autocast(fn, dtype=jnp.{name}), or "
            f"@jaxscale.autocast(dtype=jnp.{name}) on the function"
        )
    if not callable(fn):
        raise TypeError(f"autocast expects a callable, got {type(fn).__name__} {fn!r}")
    kind = dtype.name + (f"+float8:{recipe.name}" if recipe is not None else "")
    kind = kind if device_type == "cuda" else f"{device_type}:{kind}"
    scope = f"{MARKER}[{kind if enabled else 'disabled'}]"

    @functools.wraps(fn)
    def autocast_fn(*args: Any, **kwargs: Any) -> Any:
        with jax.named_scope(scope), autocast_state(enabled, dtype, device_type):
            if not enabled:
                return fn(*args, **kwargs)
            refuse_inside_hidden_state(getattr(fn, "__name__", type(fn).__name__))
            autocaster = Autocaster(
                dtype, recipe, device_type, grad_dtype=gradients, float8_filter=site_filter,
                key=key,
            )  # fmt: skip
            if not isinstance(site_filter, LayerFilter):
                return _run(autocaster, fn, args, kwargs)
            progress = site_filter.progress()
            result = _run(autocaster, fn, args, kwargs)
            site_filter.check_since(progress)  # a filter that found no layer is a mistake
            return result

    return autocast_fn


class _Decorator:
    """``autocast(dtype=...)`` without a function: a decorator. Used as a context
    manager (PyTorch's ``with torch.autocast("cuda"):``) it explains the function form:
    a ``with`` block inside a traced function is traced into the caller's program as it
    goes, and nothing JAX offers a library can rewrite it afterwards."""

    def __init__(
        self, device_type: str, dtype: np.dtype, enabled: bool, recipe: Any, grad_dtype: Any,
        float8_filter: Any, key: Any,
    ):  # fmt: skip
        self._options = {
            "device_type": device_type, "dtype": dtype, "enabled": enabled, "float8": recipe,
            "grad_dtype": grad_dtype, "float8_filter": float8_filter, "key": key,
        }  # fmt: skip

    def __call__(self, fn: Callable[..., Any]) -> Any:
        return autocast(fn, **self._options)

    def __enter__(self) -> None:
        raise TypeError(
            "jaxscale.autocast is a function transform, not a context manager: JAX traces "
            "the code of a with-block into the enclosing program as it runs, so no library "
            "can rewrite it at the end of the block. Apply it to the function the block "
            "would hold, e.g. `loss = jaxscale.autocast(loss_fn)(model, x, y)` or decorate "
            "it with `@jaxscale.autocast(dtype=jnp.bfloat16)`; "
            "`jaxscale.autocast(g, enabled=False)(...)` inside it is PyTorch's nested "
            "`with autocast(enabled=False):`."
        )

    def __exit__(self, *exc: Any) -> None:
        return None


def _run(
    autocaster: Autocaster, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    with state_writes_marked():
        call = TracedCall(fn, args, kwargs)
    autocaster.name_inputs(call.inputs, call.input_paths)
    outs = autocaster.run(call.closed, call.inputs, [Tag.GIVEN] * len(call.inputs))
    count = len(outs) - len(call.state_dtypes)
    # state written by the call goes back in the dtypes it was traced with, as PyTorch
    # updates a buffer in place: an NNX module's variables, and an Equinox State among
    # the results (Linen's and Haiku's writes were marked while the call was traced)
    traced = [aval.dtype for aval in call.closed.out_avals[:count]]
    results = [
        cast_floating([out], [dtype])[0] if threaded else out
        for out, dtype, threaded in zip(outs[:count], traced, call.threaded_outputs, strict=True)
    ]
    return call.finish([*results, *cast_floating(outs[count:], call.state_dtypes)])


def _is_a_dtype(value: Any) -> bool:
    """A dtype or scalar type (``jnp.float16``, ``np.dtype("bfloat16")``), which is
    callable and so could pass for the function to transform."""
    if not isinstance(value, type | np.dtype):
        return False
    try:
        np.dtype(value)
    except TypeError:
        return False
    return True


def _validated_filter(float8_filter: Any, recipe: Any) -> Any:
    if float8_filter is None:
        return None
    if not callable(float8_filter):
        raise TypeError(
            "float8_filter must be a function of a jaxscale.casting.MatmulSite returning a "
            f"bool, got {type(float8_filter).__name__} {float8_filter!r}"
        )
    if recipe is None:
        raise ValueError(
            "float8_filter chooses which matmuls run in the float8 recipe, and no recipe is "
            "given: pass float8='rowwise' (or another recipe) too"
        )
    return float8_filter


def _check_key(key: Any, recipe: Any) -> None:
    if key is None:
        if isinstance(recipe, NVFP4Recipe) and recipe.stochastic_rounding:
            raise ValueError(
                "the nvfp4 recipe rounds output gradients stochastically and needs a key: "
                "pass jaxscale.autocast(..., float8='nvfp4', key=jax.random.key(step)), or "
                "float8=jaxscale.casting.NVFP4Recipe(stochastic_rounding=False)"
            )
        if rounds_stochastically(recipe):
            raise ValueError(
                f"the float8 recipe {recipe.name!r} rounds output gradients stochastically "
                "(stochastic_gradients=True) and needs a key: pass jaxscale.autocast(..., "
                "key=jax.random.fold_in(key, step))"
            )
        return
    if not rounds_stochastically(recipe):
        raise ValueError(
            f"key is drawn from only by a float8 recipe that rounds stochastically "
            f"(float8='nvfp4', or a recipe with stochastic_gradients=True), got "
            f"float8={getattr(recipe, 'name', recipe)!r}: drop key, or choose such a recipe"
        )
    dtype = getattr(key, "dtype", None)
    typed = dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)
    raw = dtype == np.uint32 and getattr(key, "shape", None) == (2,)
    if not (typed or raw):
        raise TypeError(
            f"key must be a JAX PRNG key, e.g. key=jax.random.key(0), got {type(key).__name__}"
        )


def _validated_grad_dtype(grad_dtype: Any) -> np.dtype | None:
    if grad_dtype is None:
        return None
    try:
        if np.dtype(grad_dtype) == np.float32:
            return np.dtype(np.float32)
    except TypeError:
        pass
    raise ValueError(
        f"grad_dtype must be None or jnp.float32, got {grad_dtype!r}: with jnp.float32 the "
        "gradients of values autocast narrows for a matmul come out of it in float32"
    )


def _validated_dtype(dtype: Any) -> np.dtype:
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        raise TypeError(
            f"autocast dtype must be jnp.float16 or jnp.bfloat16, got {dtype!r}"
        ) from None
    if resolved not in _DTYPES:
        raise ValueError(f"autocast dtype must be float16 or bfloat16, got {resolved.name}")
    return resolved
