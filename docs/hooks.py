"""MkDocs hook: the build fails when a public name has no docstring.

The public names are ``spmd_types.__all__`` and ``spmd_types.testing.__all__``;
the API page (docs/api.md) renders their docstrings with mkdocstrings.
"""

from __future__ import annotations

import importlib
import inspect

PUBLIC_MODULES = ("spmd_types", "spmd_types.testing")


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
