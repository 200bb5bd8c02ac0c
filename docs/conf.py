"""Sphinx configuration for the jaccum site: Markdown pages (MyST), the book theme,
and an API reference generated from the Google-style docstrings.

Build it strictly, as CI does:

  pip install -e ".[docs]"
  python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

import pathlib
import sys

# The checkout's jaccum, whether or not an installed copy is on the path.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jaccum

project = "jaccum"
author = "The jaccum authors"
copyright = "2026, The jaccum authors"
release = jaccum.__version__
version = jaccum.__version__

extensions = [
  "myst_parser",
  "sphinx.ext.autodoc",
  "sphinx.ext.napoleon",
  "sphinx.ext.viewcode",
]

source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]

# MyST: anchors for headings down to ### so guides can link to sections.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "dollarmath"]

# Docstrings: Google style; `x` means code, as in Markdown.
default_role = "code"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# Attributes as a field list, so NamedTuple fields are not documented twice;
# their docstrings say the types in words (annotations read `jax.Array` as
# `jax.jaxlib._jax.Array`).
napoleon_use_ivar = True
napoleon_attr_annotations = False
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True

html_theme = "sphinx_book_theme"
html_title = f"jaccum {jaccum.__version__}"
html_static_path = ["_static"]
html_theme_options = {
  "repository_url": "https://github.com/jaccum/jaccum",
  "use_repository_button": True,
  "home_page_in_toc": True,
  "show_navbar_depth": 1,
}
