"""Which matmuls run in a float8 recipe: what a filter is told about each, and the
filters people write.

``autocast(fn, float8=recipe, float8_filter=keep)`` calls ``keep(site)`` once for each
matmul the recipe could take, when ``fn`` is traced; a matmul it refuses runs as the
autocast ``dtype`` says (its forward and both backward matmuls together). The
:class:`MatmulSite` names the matmul the ways a user knows it: its name stack
(``jax.named_scope``, Linen's and Haiku's module paths), the path of the argument its
weight comes from (NNX's and Equinox's attribute names), its source line, its shapes,
and, inside a ``lax.scan`` over stacked layers, which layer.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Callable
from typing import Any

# A path's parts: ``['name']``, ``[3]`` and ``.name`` of jax.tree_util.keystr, and the
# ``/``-separated scopes of a name stack.
_PATH_PART = re.compile(r"\['([^']*)'\]|\[(\d+)\]|\.([A-Za-z_]\w*)|([^/\[\].']+)")
# Linen numbers the modules of a list attribute ``layers_0``, ``layers_1``, ...
_NUMBERED = re.compile(r"^(.*)_(\d+)$")


@dataclasses.dataclass(frozen=True)
class MatmulSite:
    """A matmul a float8 recipe could run, as ``autocast``'s ``float8_filter`` sees it.

    Attributes:
      name_stack: JAX's name stack at the matmul, ``/``-joined, without the transforms
        JAX adds (``jit(...)``, ``jvp(...)``) and autocast's own scope: the scopes of
        ``jax.named_scope``, Linen's module path (``"Transformer/lm_head"``), Haiku's
        (``"transformer/lm_head"``); Equinox's vmapped layers appear as
        ``"vmap(eqx.nn.Linear)"``; NNX adds nothing.
      weight: the path of the function's argument the matmul's weight is a view of, in
        ``jax.tree_util.keystr`` form with the argument's position first: NNX
        ``"[0]['lm_head']['kernel'].value"``, Linen ``"[0]['params']['lm_head']['kernel']"``,
        Equinox ``"[0].lm_head.weight"``; ``None`` when neither operand is one (both are
        computed, as attention's are).
      source: ``"file.py:LINE"`` of the user's line that traced the matmul (``""`` when
        JAX recorded none).
      shapes: the two operands' shapes.
      dims: ``(M, K, N)``: the rows, contracted size and columns of the matmul as a
        linear layer (``x`` ``(M, K)`` times ``w`` ``(K, N)``).
      index: its position among the function's eligible matmuls, in the order traced.
      layer, layers: inside a ``lax.scan`` (``nnx.scan``, ``nn.scan``, ``eqx`` or Haiku
        stacks built on it), the iteration the decision is asked for and the scan's
        length; ``None`` outside one. autocast asks for every layer and splits the scan
        where the answer changes.
    """

    name_stack: str
    weight: str | None
    source: str
    shapes: tuple[tuple[int, ...], tuple[int, ...]]
    dims: tuple[int, int, int]
    index: int
    layer: int | None = None
    layers: int | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """Every part of :attr:`name_stack` and :attr:`weight`: the names a pattern of
        :func:`exclude_names` is matched against one by one."""
        return tuple(_parts(self.name_stack) + _parts(self.weight or ""))

    def _paths(self) -> tuple[list[str], list[str]]:
        """The name stack's parts and the weight path's, read apart: the argument position
        a path starts with (``[0]``) follows no name of its own, and would follow the name
        stack's last part if the two were read as one."""
        return _parts(self.name_stack), _parts(self.weight or "")

    def list_index(self, name: str) -> int | None:
        """The position of this matmul's layer in a list attribute ``name`` (NNX's and
        Equinox's ``layers[3]``, Linen's ``layers_3``), or ``None``."""
        for parts in self._paths():
            for i, part in enumerate(parts):
                if part == name and i + 1 < len(parts) and parts[i + 1].isdigit():
                    return int(parts[i + 1])
                numbered = _NUMBERED.match(part)
                if numbered and numbered[1] == name:
                    return int(numbered[2])
        return None

    def list_names(self) -> tuple[str, ...]:
        """The names of the lists this matmul's names index into: ``blocks`` of
        ``blocks[3]`` (NNX, Equinox) and of ``blocks_3`` (Linen, Haiku), outermost first."""
        found: list[str] = []
        for parts in self._paths():
            for i, part in enumerate(parts):
                numbered = _NUMBERED.match(part)
                if i + 1 < len(parts) and parts[i + 1].isdigit():
                    found.append(part)
                elif numbered:
                    found.append(numbered[1])
        return tuple(dict.fromkeys(name for name in found if name.isidentifier()))


def _parts(text: str) -> list[str]:
    """A name stack's or a path's parts (see ``_PATH_PART``)."""
    return [next(p for p in match.groups() if p is not None) for match in _PATH_PART.finditer(text)]


Filter = Callable[[MatmulSite], bool]


def exclude_names(*patterns: str) -> Filter:
    """A ``float8_filter`` that keeps in the autocast dtype the matmuls whose names
    match any of ``patterns`` (shell-style, as :mod:`fnmatch`): torchao's
    ``module_filter_fn`` on a name.

    A pattern matches a site when it matches its whole :attr:`MatmulSite.name_stack`,
    its whole :attr:`MatmulSite.weight`, or any one of its :attr:`MatmulSite.names`.
    ``"lm_head"`` excludes the output head in every framework (Linen's
    ``"LM/lm_head"``, NNX's ``"[0]['lm_head']['kernel'].value"``, Equinox's
    ``"[0].lm_head.weight"``); ``"*attn*"`` every matmul under a scope or attribute
    whose name contains ``attn``.

    Example:
      >>> import jax.numpy as jnp, jaxscale
      >>> from jaxscale.casting import exclude_names
      >>> def model(params, x):
      ...     return jnp.tanh(x @ params["body"]) @ params["lm_head"]
      >>> params = {"body": jnp.ones((32, 32)), "lm_head": jnp.ones((32, 16))}
      >>> step = jaxscale.autocast(model, dtype=jnp.bfloat16, float8="rowwise",
      ...                          float8_filter=exclude_names("lm_head"))
      >>> step(params, jnp.ones((16, 32))).dtype
      dtype(bfloat16)
    """
    if not patterns:
        # (a filter of no patterns would keep every matmul in the recipe, silently)
        raise TypeError(
            'exclude_names needs at least one pattern, e.g. exclude_names("lm_head"); to '
            "run every matmul in the recipe, pass no float8_filter"
        )
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern:
            raise TypeError(f"exclude_names takes non-empty strings, got {pattern!r}")

    def keep(site: MatmulSite) -> bool:
        texts = (site.name_stack, site.weight or "", *site.names)
        return not any(fnmatch.fnmatchcase(t, p) for p in patterns for t in texts if t)

    keep.__qualname__ = f"exclude_names{patterns!r}"
    return keep


def exclude_layers(first: int = 0, last: int = 0, *, name: str = "layers",
                   count: int | None = None) -> Filter:  # fmt: skip
    """A ``float8_filter`` that keeps the first ``first`` and last ``last`` layers of
    a stack in the autocast dtype: Megatron's ``num_layers_at_start_in_bf16`` and
    ``num_layers_at_end_in_bf16``.

    A layer is found two ways. Inside a ``lax.scan`` over stacked layers (``nnx.scan``,
    Linen's ``nn.scan``, ``jax.lax.scan`` of a layer function) it is the scan's
    iteration, and the scan's length is the number of layers: autocast splits the scan
    where the answer changes, so the kept layers run without the recipe. Otherwise it
    is the index after ``name`` in the site's names (``layers[3]`` of NNX and Equinox,
    ``layers_3`` of Linen and Haiku; Haiku's first instance of a module, ``layers``
    without a number, is layer 0), out of ``count`` layers. Matmuls in no layer (an embedding
    projection, the output head) are left to the recipe: combine with
    :func:`exclude_names` to keep those too. A function none of whose matmuls is in a
    layer makes ``autocast`` raise ``ValueError`` naming the lists the weights are in
    (a list named otherwise than ``name`` would leave the filter keeping nothing); so
    does a position at or beyond ``count``.

    Example:
      >>> import jax, jax.numpy as jnp, jaxscale
      >>> from jaxscale.casting import exclude_layers
      >>> def stack(ws, x):
      ...     return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]
      >>> step = jaxscale.autocast(stack, dtype=jnp.bfloat16, float8="rowwise",
      ...                          float8_filter=exclude_layers(first=1, last=1))
      >>> step(jnp.ones((6, 32, 32)) / 32, jnp.ones((16, 32))).shape
      (16, 32)
    """
    for label, value in (("first", first), ("last", last)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"exclude_layers: {label} must be an int >= 0, got {value!r}")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise ValueError(f"exclude_layers: count must be None or an int >= 1, got {count!r}")
    if not isinstance(name, str) or not name:
        raise TypeError(f"exclude_layers: name must be a non-empty string, got {name!r}")
    return LayerFilter(first, last, name, count)


class LayerFilter:
    """The filter :func:`exclude_layers` returns.

    Besides answering each site, it counts the sites it was asked about and those it
    found in a layer, so that ``autocast`` can refuse a filter that found no layer in a
    whole function (a list named otherwise than ``name``): it would keep every matmul in
    the recipe without a word.
    """

    def __init__(self, first: int, last: int, name: str, count: int | None):
        self.first, self.last, self.name, self.count = first, last, name, count
        self.asked = 0
        self.in_layers = 0
        # sites read as layer 0 because a scope of their name stack is ``name`` itself
        # (Haiku's first instance of a module), and sites found at a numbered position
        self.unnumbered = 0
        self.numbered = 0
        self.other_lists: dict[str, None] = {}  # lists the unplaced sites are in, in order
        self.__qualname__ = f"exclude_layers(first={first}, last={last})"

    def __repr__(self) -> str:
        return self.__qualname__

    def __call__(self, site: MatmulSite) -> bool:
        self.asked += 1
        position: int | None
        if site.layer is not None and site.layers is not None:
            position, total = site.layer, site.layers
        else:
            position = site.list_index(self.name)
            if position is not None:
                self.numbered += 1
            elif self.name in _parts(site.name_stack):
                # Haiku numbers a module's instances ``block``, ``block_1``, ``block_2``:
                # the first has no number. (A module named ``name`` that holds the layers
                # instead has no numbered sibling: check_since refuses it.)
                position = 0
                self.unnumbered += 1
            if position is None:
                for list_name in site.list_names():
                    self.other_lists.setdefault(list_name)
                return True
            where = site.source or site.name_stack or site.weight
            if self.count is None:
                raise ValueError(
                    f"exclude_layers: the matmul at {where} is in "
                    f"{self.name}[{position}] of a list of layers, and how many layers the "
                    f"list has is not known: pass count=len(model.{self.name})"
                )
            total = self.count
            if position >= total:
                raise ValueError(
                    f"exclude_layers: the matmul at {where} is in {self.name}[{position}], "
                    f"beyond count={total} layers: pass count=len(model.{self.name})"
                )
        self.in_layers += 1
        return self.first <= position < total - self.last

    def progress(self) -> tuple[int, int, int, int]:
        """``(asked, in_layers, unnumbered, numbered)`` so far: what :meth:`check_since`
        compares with."""
        return self.asked, self.in_layers, self.unnumbered, self.numbered

    def check_since(self, progress: tuple[int, int, int, int]) -> None:
        """Raises when the filter was asked about matmuls since ``progress`` and found
        none of them in a layer (a scan's iteration or ``name[i]``), or read some as
        layer 0 by a scope named ``name`` where no other layer had a number."""
        asked, in_layers, unnumbered, numbered = progress
        if self.unnumbered != unnumbered and self.numbered == numbered and self.count != 1:
            raise ValueError(
                f"{self.__qualname__}: the function's matmuls under the scope "
                f"{self.name!r} have no numbered sibling ({self.name}_1, {self.name}_2, "
                f"...), so {self.name!r} holds the layers rather than being the first of "
                f"them: pass name= the layers' own name (Haiku numbers a module's "
                f"instances {self.name!r}, {self.name + '_1'!r}, ...)"
            )
        if self.asked == asked or self.in_layers != in_layers:
            return
        found = [n for n in self.other_lists if n != self.name]
        hint = (
            f"; the matmuls' weights are in lists named {', '.join(map(repr, found))}: "
            f"pass name={found[0]!r}"
            if found
            else ": a layer is an iteration of a lax.scan over stacked layers, or an "
            f"element of a list attribute named {self.name!r} (pass name= for another)"
        )
        raise ValueError(
            f"{self.__qualname__} found none of the function's {self.asked - asked} "
            f"float8 matmuls in a layer, so it would keep none out of the recipe: no "
            f"matmul is in a scan over layers or in a list named {self.name!r}{hint}"
        )


def auto_filter(recipe: str = "rowwise", exclude: tuple[str, ...] = ()) -> Filter:
    """torchao's ``_auto_filter_for_recipe(recipe, filter_fqns=exclude)``: the matmuls
    large enough for a float8 matmul to be faster than bfloat16 on an H100, by
    torchao's thresholds on a linear layer's ``K`` (in features) and ``N`` (out
    features), and no name containing any string of ``exclude`` (a substring, as
    torchao matches fully qualified names).

    ``"rowwise"``: ``N > 2048``, ``K > 1024``, and not both ``N <= 4096`` and
    ``K <= 2048``. ``"tensorwise"``: not both ``K <= 4096`` and ``N <= 1024``. Both
    ask that ``K`` and ``N`` be multiples of 16. The thresholds are torchao's
    measurements on one GPU; :func:`jaxscale.float8_report` measures the error each
    matmul's recipe adds instead.
    """
    if recipe not in ("rowwise", "tensorwise"):
        raise ValueError(
            f"auto_filter has torchao's thresholds for 'rowwise' and 'tensorwise', got {recipe!r}"
        )
    if isinstance(exclude, str):
        exclude = (exclude,)

    def keep(site: MatmulSite) -> bool:
        texts = (site.name_stack, site.weight or "")
        if any(part in text for part in exclude for text in texts):
            return False
        _, k, n = site.dims
        if k % 16 or n % 16:
            return False
        if recipe == "tensorwise":
            return not (k <= 4096 and n <= 1024)
        return not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))

    keep.__qualname__ = f"auto_filter({recipe!r})"
    return keep


def checked_answer(answer: Any, keep: Any, site: MatmulSite) -> bool:
    """``keep(site)``'s answer, which must be a bool (an array would decide nothing at
    trace time)."""
    if isinstance(answer, bool):
        return answer
    if type(answer).__name__ == "bool_":  # numpy's bool
        return bool(answer)
    raise TypeError(
        f"float8_filter must return a Python bool, got {type(answer).__name__} "
        f"{answer!r} from {getattr(keep, '__qualname__', keep)!r} for the matmul at "
        f"{site.source or site.name_stack}"
    )
