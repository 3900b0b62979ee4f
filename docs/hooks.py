"""MkDocs hooks: the build fails when a public name has no docstring; the API page reads as prose.

The public names are ``__all__`` of ``spmd_types``, ``spmd_types.testing`` and ``spmd_types.megatron``;
the API page (docs/api.md) renders their docstrings with mkdocstrings, which
leaves Sphinx's roles (``:func:`x```) and literal-block colons (``Example::``)
as written: :func:`on_page_content` drops them there.
"""

from __future__ import annotations

import importlib
import inspect
import re

PUBLIC_MODULES = ("spmd_types", "spmd_types.testing", "spmd_types.megatron")


def undocumented() -> list[str]:
    """``module.name`` of every public name whose docstring is missing or empty."""
    missing = []
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            if not (inspect.getdoc(getattr(module, name)) or "").strip():
                missing.append(f"{module_name}.{name}")
    return missing


def on_pre_build(config, **kwargs) -> None:
    from mkdocs.exceptions import PluginError

    missing = undocumented()
    if missing:
        raise PluginError("public names without a docstring: " + ", ".join(missing))


_ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|exc|obj):(<code>)")
_LITERAL_COLONS = re.compile(r"(<p>)?::</p>")


def on_page_content(html: str, page, config, files) -> str:
    """On the API page: ``:func:<code>x</code>`` -> ``<code>x</code>``, ``Example::`` -> ``Example:``."""
    if page.file.src_uri != "api.md":
        return html
    html = _ROLE.sub(r"\1", html)
    return _LITERAL_COLONS.sub(lambda m: "" if m.group(1) else ":</p>", html)  # a lone "::" goes
