"""Sphinx configuration: the jaxscale documentation site, built from the README's
sections, the docstrings, the notebooks and the benchmark results.

    sphinx-build -W -b html docs docs/_build/html      # warnings are errors
    sphinx-build -W -b doctest docs docs/_build/doctest
"""

from __future__ import annotations

import pathlib
import shutil

import jaxscale

HERE = pathlib.Path(__file__).resolve().parent

# The notebooks live in notebooks/ with their outputs; Sphinx reads them from here.
(HERE / "notebooks").mkdir(exist_ok=True)
for notebook in sorted((HERE.parent / "notebooks").glob("*.ipynb")):
    shutil.copy2(notebook, HERE / "notebooks" / notebook.name)
# README sections included here show the examples' figures by their path in the repository
# (the images only: the tables beside them are in the README's text already)
shutil.copytree(HERE.parent / "examples" / "figures", HERE / "examples" / "figures",
                dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.md"))  # fmt: skip

project = "jaxscale"
author = "The jaxscale authors"
copyright = "2026, The jaxscale authors"
release = jaxscale.__version__

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",
]
exclude_patterns = ["_build"]
myst_heading_anchors = 3
nb_execution_mode = "off"  # the notebooks are committed executed; the tests run them
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
doctest_global_setup = "import jax, jax.numpy as jnp, optax, jaxscale"
html_theme = "furo"
html_title = f"jaxscale {release}"
suppress_warnings = ["myst.header"]  # README sections start below its top heading
html_static_path = ["_static"]
html_css_files = ["tables.css"]  # code in table cells wraps, so wide tables fit the page
