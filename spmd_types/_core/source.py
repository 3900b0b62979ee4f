"""Recover the user's own expressions for an op's operands from their source line.

Error messages name operands by parameter (``input``, ``weight``); when the
user's line is simple enough to parse, the fix is spelled with the user's own
expression instead (``spmd.convert(self.w1, ...)``).
"""

from __future__ import annotations

import ast

__all__ = ["operand_expressions"]

_BINOPS = {
    "add": ast.Add, "sub": ast.Sub, "mul": ast.Mult, "truediv": ast.Div, "div": ast.Div,
    "matmul": ast.MatMult, "pow": ast.Pow, "floordiv": ast.FloorDiv, "mod": ast.Mod,
}
_MODULE_NAMES = {"torch", "F", "functional", "nn", "spmd", "linalg"}


def _parse(code: str) -> ast.AST | None:
    text = code.strip()
    for candidate in (text, text.rstrip(":"), text.split(" #")[0]):
        try:
            return ast.parse(candidate)
        except SyntaxError:
            continue
    for prefix in ("if ", "elif ", "while ", "return ", "with "):
        if text.startswith(prefix):
            try:
                return ast.parse(text[len(prefix):].rstrip(":"))
            except SyntaxError:
                return None
    return None


def _dunder_core(name: str) -> tuple[str, bool]:
    core = name.strip("_")
    reflected = core.startswith("r") and core[1:] in _BINOPS
    inplace = core.startswith("i") and core[1:] in _BINOPS
    return (core[1:] if reflected or inplace else core), reflected


def _is_module_path(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id in _MODULE_NAMES
    if isinstance(node, ast.Attribute):
        return node.attr in _MODULE_NAMES or _is_module_path(node.value)
    return False


def operand_expressions(code: str, attr_name: str, params: tuple[str, ...]) -> dict[str, str]:
    """Map parameter names to source expressions, when exactly one call on the line fits.

    Example::

        >>> operand_expressions("h = x @ self.w1", "__matmul__", ("input", "other"))
        {'input': 'x', 'other': 'self.w1'}
    """
    tree = _parse(code)
    if tree is None:
        return {}
    src = ast.unparse
    found: list[dict[str, str]] = []
    if attr_name.startswith("__"):
        core, reflected = _dunder_core(attr_name)
        op_type = _BINOPS.get(core)
        for node in ast.walk(tree):
            if op_type and isinstance(node, ast.BinOp) and isinstance(node.op, op_type):
                left, right = src(node.left), src(node.right)
                found.append({params[0]: right, params[1]: left} if reflected else {params[0]: left, params[1]: right})
            elif op_type and isinstance(node, ast.AugAssign) and isinstance(node.op, op_type):
                found.append({params[0]: src(node.target), params[1]: src(node.value)})
        return found[0] if len(found) == 1 else {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        fn = node.func
        name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else None
        if name != attr_name:
            continue
        exprs = [src(a) for a in node.args if not isinstance(a, ast.Starred)]
        if isinstance(fn, ast.Attribute) and not _is_module_path(fn.value):
            exprs.insert(0, src(fn.value))
        mapping = {p: e for p, e in zip(params, exprs) if not p.startswith("*")}
        for p, arg in zip(params, node.args):
            if isinstance(arg, (ast.List, ast.Tuple)):
                mapping.update({f"{p}[{j}]": src(e) for j, e in enumerate(arg.elts)})
        mapping.update({kw.arg: src(kw.value) for kw in node.keywords if kw.arg})
        found.append(mapping)
    return found[0] if len(found) == 1 else {}
