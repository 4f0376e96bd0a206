"""Evaluating jaxprs again: binding a traced equation's primitive on new values."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def bind_equation(
    eqn: Any, invals: Sequence[Any], params: dict[str, Any] | None = None
) -> list[Any]:
    """Bind ``eqn``'s primitive anew on ``invals`` (with ``params`` replacing its own).

    Uses JAX's own protocol for binding a traced equation again
    (``get_bind_params``), which turns a higher-order primitive's inner jaxprs
    back into the functions its ``bind`` takes. Returns the list of results.
    """
    result = eqn.primitive.get_bind_params(params or eqn.params)
    if isinstance(result, tuple):  # (subfuns, params), before JAX 0.7
        out = eqn.primitive.bind(*result[0], *invals, **result[1])
    else:
        out = eqn.primitive.bind(*invals, **result)
    return list(out) if eqn.primitive.multiple_results else [out]
