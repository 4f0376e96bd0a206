"""Print pip constraints pinning every dependency of jaxscale to its declared minimum.

    python .ci/minimum_versions.py > constraints.txt
    pip install -c constraints.txt -e ".[test]"

The floors are the ``>=`` bounds of ``[project] dependencies`` in pyproject.toml (a
``<`` ceiling after one is allowed), so the CI stage that installs them tests exactly
what the package promises.
"""

from __future__ import annotations

import pathlib
import re
import tomllib

PYPROJECT = pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml"


def minimums() -> dict[str, str]:
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    found = {}
    for requirement in dependencies:
        # a floor, and optionally a ceiling after it (">=0.10.0,<0.12.1")
        match = re.fullmatch(
            r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)(?:\s*,\s*<\s*[0-9][0-9A-Za-z.]*)?",
            requirement,
        )
        if match is None:
            raise SystemExit(f"dependency without a '>=' floor: {requirement!r}")
        found[match.group(1)] = match.group(2)
    return found


if __name__ == "__main__":
    for name, version in minimums().items():
        print(f"{name}=={version}")
