"""Names of the scopes one layer writes around the operations it creates and another
reads back from a traced program's name stacks.

Autocast's float8 matmul quantizes its operands, multiplies them in float8, rescales
the float32 product and casts it to the autocast dtype, all under
:data:`FLOAT8_MATMUL`; :func:`jaxscale.locate_nonfinite` names an inf born anywhere in
it (in practice the final cast, where a product beyond float16's range overflows) as
the float8 matmul's, the operation the user wrote.
"""

from __future__ import annotations

import re

FLOAT8_MATMUL = "float8_matmul"

_FLOAT8_MATMUL_IN_A_STACK = re.compile(rf"(^|[/(]){FLOAT8_MATMUL}($|[/)])")


def in_float8_matmul(name_stack: str) -> bool:
    """Whether an equation with this name stack (``"jvp(float8_matmul)"``,
    ``"block/float8_matmul"``) belongs to a float8 matmul."""
    return _FLOAT8_MATMUL_IN_A_STACK.search(name_stack) is not None
