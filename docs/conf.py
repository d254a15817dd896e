"""Sphinx configuration: the API reference from docstrings, the guides as Markdown (MyST).

Built in CI as a check that the docs build (``python -m sphinx -W -b html docs <out>``); not published.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

project = "FlexSP"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "myst_parser"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": True}
myst_heading_anchors = 3
suppress_warnings = ["myst.header", "myst.xref_missing", "autodoc.import_object"]
html_theme = "alabaster"
