"""The examples in the documentation run: docstrings and the README's Python blocks."""

import doctest
import importlib
import pkgutil
import re

import pytest
from support import paths, third_party

import jaxscale

ROOT = paths.ROOT
MODULES = sorted(
    name for _, name, _ in pkgutil.walk_packages(jaxscale.__path__, prefix="jaxscale.")
)


def test_every_module_is_collected_and_examples_exist():
    assert "jaxscale.transform._grad_scaler" in MODULES
    assert "jaxscale.core._rule" in MODULES
    finder = doctest.DocTestFinder(exclude_empty=True)
    examples = sum(
        len(test.examples)
        for name in MODULES
        for test in finder.find(importlib.import_module(name), name, globs={})
    )
    assert examples >= 40


@pytest.mark.parametrize("module_name", MODULES)
def test_docstring_examples_run(module_name):
    module = importlib.import_module(module_name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    # docstring examples are user code, as the README's blocks are: JAX's default
    # (standard) promotion, under which optax adds a float32 update to a bfloat16
    # parameter; jaxscale's own code is held to strict promotion by the other tests
    with third_party.standard_promotion():
        for test in finder.find(module, module_name, globs={}):
            runner.run(test)
    assert runner.failures == 0, f"{runner.failures} docstring example(s) failed in {module_name}"


DOC_PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]


def python_blocks(page: str) -> list[str]:
    text = (ROOT / page).read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


BLOCKS = [(page, index) for page in DOC_PAGES for index in range(len(python_blocks(page)))]


def test_the_readme_and_the_guides_have_python_examples():
    assert len(python_blocks("README.md")) >= 1
    assert len(BLOCKS) >= 15


@pytest.mark.parametrize(("page", "index"), BLOCKS, ids=[f"{p}-{i}" for p, i in BLOCKS])
def test_every_python_block_of_the_readme_and_the_docs_runs(page, index, capsys, tmp_path,
                                                             monkeypatch):  # fmt: skip
    # documented code is user code: it runs under JAX's default (standard) promotion, in
    # a folder of its own (a block may write a checkpoint or a plot)
    monkeypatch.chdir(tmp_path)
    with third_party.standard_promotion():
        exec(compile(python_blocks(page)[index], f"{page} block {index}", "exec"), {})


def test_the_api_reference_lists_every_public_name():
    api = (ROOT / "docs" / "api.rst").read_text()
    documented = set(re.findall(r"^\.\. auto\w+:: jaxscale\.(\w+)\s*$", api, flags=re.MULTILINE))
    assert documented == set(jaxscale.__all__) - {"__version__"}


def test_the_development_guide_gives_one_command_that_builds_the_docs():
    assert (
        'pip install -e ".[docs]" && sphinx-build -W -b html docs docs/_build/html'
        in (ROOT / "docs" / "development.md").read_text()
    )
    assert "docs/development.md" in (ROOT / "README.md").read_text()


def test_the_readme_is_a_front_door():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for page in ("autocast", "float8", "low_precision", "loss_scaling", "diagnosis", "porting"):
        assert f"(docs/{page}.md)" in readme, page
    assert "{include} ../README.md" not in "".join(
        (ROOT / "docs" / p).read_text() for p in [p.name for p in (ROOT / "docs").glob("*.md")]
    )


# The guides' measured tables are the files the example writes, copied verbatim: each
# names the command that wrote it, and this keeps the two from drifting apart.
MEASURED_TABLES = {
    "examples/figures/float8_policy_nvfp4.md": (
        "python examples/float8_policy.py --recipe nvfp4 --keep-at-most 0.15 --table "
        "examples/figures/float8_policy_nvfp4.md"
    ),
    "examples/figures/precision_comparison.md": (
        "python examples/compare_precisions.py --devices 1 256"
    ),
    "examples/figures/float8_comparison.md": (
        "python examples/compare_precisions.py --float8 --devices 1 --plot "
        "examples/figures/float8_comparison.png"
    ),
    "examples/figures/low_precision.md": (
        "python examples/compare_low_precision.py --plot examples/figures/low_precision.png"
    ),
    "examples/figures/low_precision_lr3e-4.md": (
        "python examples/compare_low_precision.py --learning-rate 3e-4 --plot "
        "examples/figures/low_precision_lr3e-4.png"
    ),
    "examples/figures/char_lm_training.md": (
        "python examples/train_char_lm.py --plot examples/figures/char_lm_training.png"
    ),
}


@pytest.mark.parametrize("path", sorted(MEASURED_TABLES))
def test_the_guides_measured_tables_are_the_files_their_command_wrote(path):
    readme = "\n".join((ROOT / "docs" / p).read_text() for p in sorted(
        q.name for q in (ROOT / "docs").glob("*.md")))  # fmt: skip
    table = (ROOT / path).read_text().strip()
    # the README may indent a table inside a list item
    readme_lines = [line.strip() for line in readme.splitlines()]
    table_lines = table.splitlines()
    starts = [
        i for i in range(len(readme_lines)) if readme_lines[i : i + len(table_lines)] == table_lines
    ]
    assert starts, f"no page of docs/ contains {path} as written"
    assert f"`{MEASURED_TABLES[path]}`" in " ".join(readme.split())  # a command may wrap
    assert len(table_lines) > 2  # a header, its rule and rows


def test_the_cores_public_names_are_documented_and_the_guides_core_table_is_in_them():
    import jaxscale.core as core

    undocumented = [
        name for name in core.__all__ if name != "AxisName" and not getattr(core, name).__doc__
    ]
    assert undocumented == []
    readme = (ROOT / "docs" / "loss_scaling.md").read_text()
    section = readme[readme.index("Core (pure, jittable functions") :]
    section = section[: section.index("\n\n", section.index("|"))]
    tabled = set(re.findall(r"^\| `(\w+)\(", section, flags=re.MULTILINE))
    assert tabled, "the loss-scaling guide's core table was not found"
    assert tabled <= set(core.__all__)
    # helpers shared between layers are not part of it
    assert not {"validation", "unscale", "require_matching", "scaler_metrics"} & set(dir(core))
