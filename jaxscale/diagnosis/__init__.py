"""Diagnosis: where an inf or NaN was born, evaluated inside ``jit`` (jax only).

:func:`locate_nonfinite` traces a function to a jaxpr, as autocast does, and
evaluates it anew carrying a small record of the first operation whose output
became non-finite: its primitive, forward or backward, the user's source line
and the loop iteration, returned as a :class:`NonfiniteReport`.
:func:`precision_stats` evaluates it the same way, carrying the ranges each matmul
and convolution works in. :func:`lowering_report` lowers a step for an accelerator
on any machine and counts what would make it wait for the host.
"""

from jaxscale.diagnosis._locate import locate_nonfinite as locate_nonfinite
from jaxscale.diagnosis._lowering import LoweringReport as LoweringReport
from jaxscale.diagnosis._lowering import lowering_report as lowering_report
from jaxscale.diagnosis._report import NonfiniteReport as NonfiniteReport
from jaxscale.diagnosis._report import Origin as Origin
from jaxscale.diagnosis._stats import format_precision_stats as format_precision_stats
from jaxscale.diagnosis._stats import precision_stats as precision_stats

__all__ = [
    "LoweringReport",
    "NonfiniteReport",
    "Origin",
    "format_precision_stats",
    "locate_nonfinite",
    "lowering_report",
    "precision_stats",
]
