"""Sphinx configuration: MyST Markdown pages, the API reference from the docstrings (autodoc + napoleon), furo.

Build: ``pip install ".[docs]" && sphinx-build -W -b html docs docs/_build/html`` from the repository root. The
API pages import the installed package (its compiled modules included), so install it first (or put the
repository root, with an in-place build of ``jax_nvfp4_kernels``, on ``PYTHONPATH``). The runnable snippets are
doctests that ``pytest`` collects (pyproject.toml).
"""

project = "jax_nvfp4"
author = "jax_nvfp4 authors"
copyright = "jax_nvfp4 authors"
release = "0.1.0"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",  # the {doctest} blocks; pytest runs them (--doctest-glob=*.md)
    "sphinx.ext.viewcode",
]

source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

# Docstrings are Google style ("Args:", "Attributes:", "Returns:").
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
autodoc_default_options: dict[str, object] = {}

html_theme = "furo"
html_title = "jax_nvfp4"
