"""Sphinx configuration of the pcast_jax documentation (``make docs``).

Pages are MyST markdown. Three kinds of page are written here at build time, from the code itself, into
``docs/_generated/`` (ignored by git): one page per kernel preset family (from
:data:`pcast_jax.presets.FAMILIES`), the examples page (from ``examples/*.py``) and the table of the
names ``pcast_jax`` exports. ``make docs`` runs ``sphinx -W --keep-going -n``: a warning, a broken
cross-reference or a renamed function fails the build.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(DOCS / "_ext"))

from sphinx.ext.napoleon.docstring import GoogleDocstring  # noqa: E402

import pcast_jax  # noqa: E402

project = "pcast_jax"
author = "the pcast_jax authors"
copyright = "the pcast_jax authors, Apache-2.0"  # noqa: A001 - Sphinx's name
release = version = pcast_jax.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "generate_pages",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

html_theme = "sphinx_book_theme"
html_title = "pcast_jax"
html_theme_options = {
    "show_toc_level": 2,
    "home_page_in_toc": True,
    "use_download_button": False,
    "use_fullscreen_button": False,
}

# The API reference: Google-style docstrings, the signature's annotations as written.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True  # a dataclass's Attributes section beside its documented fields: no duplicates
autodoc_member_order = "bysource"
add_function_parentheses = False  # a name in the guides reads as written
autodoc_typehints = "none"
autodoc_default_options = {"undoc-members": True}


def _attribute_as_written(self):
    """Napoleon reads a data docstring's first line as ``type: description``; these are prose."""
    return self._consume_to_end()


GoogleDocstring._parse_attribute_docstring = _attribute_as_written

# nitpicky (-n): every reference must resolve. No intersphinx (the build must work offline): a name
# that is not documented here (another project's, or a private helper) is shown as code when it
# exists in the installed code, and fails the build when it does not (_resolve_short_name below).
nitpicky = True


def _exists(scope: str | None, dotted: str) -> bool:
    """Whether ``scope.dotted`` (or ``dotted`` alone) names an object in the code."""
    import importlib

    parts = ((scope + ".") if scope else "").split(".")[:-1] + dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if attr in getattr(obj, "__dataclass_fields__", {}):  # a field without a class default
                obj = None
            elif hasattr(obj, attr):
                obj = getattr(obj, attr)
            else:
                return False
        return True
    return False


def _resolve_short_name(app, env, node, contnode):
    """Resolve a Python name that Sphinx could not (``KernelConfig`` in a docstring of another module).

    Docstrings name objects as their own module sees them; when no object has that exact name, the
    one documented object whose full name ends with it is taken. Otherwise the name is shown as code
    if it exists in the installed code (seen from the docstring's module or class, from any module of
    the package, or as a full name), and the reference stays broken, failing the build, if it does not.
    """
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip(".~")
    domain = env.get_domain("py")
    found = {name for name in domain.objects if name.endswith("." + target)}
    canonical = {name for name in found if not domain.objects[name].aliased}
    found = canonical or found
    if len(found) != 1:
        # not documented (a private helper, a module without a page): shown as code, without a link,
        # provided the name exists in the code as the docstring's module sees it
        context = [node.get("py:module"), node.get("py:class")]
        scopes = [None, context[0], ".".join(filter(None, context)) or None]
        scopes += [m for m in sorted(sys.modules) if m.startswith(("pcast_jax.", "pallas_kernels."))]
        return contnode if any(_exists(scope, target) for scope in scopes) else None
    (name,) = found
    obj = domain.objects[name]
    from sphinx.util.nodes import make_refnode

    return make_refnode(app.builder, node["refdoc"], obj.docname, obj.node_id, contnode, name)


_BARS = re.compile(r"(?<![\\|`\w])\|(?=[^\s|])([^|`\n]*?[^\s\\|])\|(?![|`\w])")


def _absolute_values_as_written(app, what, name, obj, options, lines):
    """``|x|`` in a docstring is an absolute value, not a reST substitution: escape its bars."""
    lines[:] = [_BARS.sub(r"\\|\1\\|", line) for line in lines]


def setup(app):
    app.connect("missing-reference", _resolve_short_name)
    app.connect("autodoc-process-docstring", _absolute_values_as_written)
