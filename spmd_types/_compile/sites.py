"""Where a node of dynamo's graph came from in the user's code: its line, and the operator written there.

Dynamo records each node's Python stack (``node.meta["stack_trace"]``). The checker reports an error at
the innermost user frame of that stack, the line eager would name.

A typed graph input's first op reaches the graph through LTensor's ``__torch_function__``, which dynamo
calls with the tensor method (``Tensor.add``) where the user wrote the operator (``x + b``); eager checks
the operator (``Tensor.__add__ (+)``, its own rule name). The recorded stack gives the operator's column,
and the file's syntax tree says whether an operator starts there.
"""

from __future__ import annotations

import ast
import functools
import linecache
import re

import torch.fx

from .._core.errors import is_user_file

__all__ = ["user_site", "user_stack", "eager_method"]

_FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line (?P<line>\d+), in [^\n]*\n(?P<rest>(?:    [^\n]*\n?)*)', re.M)

_BINOPS = {
    ast.Add: "add", ast.Sub: "sub", ast.Mult: "mul", ast.Div: "div", ast.MatMult: "matmul", ast.Pow: "pow",
    ast.FloorDiv: "floor_divide", ast.Mod: "remainder", ast.BitAnd: "bitwise_and", ast.BitOr: "bitwise_or",
    ast.BitXor: "bitwise_xor",
}
_COMPARES = {ast.Eq: "eq", ast.NotEq: "ne", ast.Lt: "lt", ast.LtE: "le", ast.Gt: "gt", ast.GtE: "ge"}
_DUNDERS = {
    "add": "add", "sub": "sub", "mul": "mul", "div": "truediv", "true_divide": "truediv", "matmul": "matmul",
    "pow": "pow", "floor_divide": "floordiv", "remainder": "mod", "bitwise_and": "and", "bitwise_or": "or",
    "bitwise_xor": "xor", "eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge",
}


def _user_frame(n: torch.fx.Node) -> re.Match | None:
    found = None
    for m in _FRAME.finditer(n.meta.get("stack_trace") or ""):
        if is_user_file(m.group("file")):
            found = m
    return found


def user_site(n: torch.fx.Node) -> tuple[str | None, int]:
    """``(file, line)`` of the innermost user frame of node ``n``'s recorded stack, or ``(None, 0)``."""
    m = _user_frame(n)
    return (None, 0) if m is None else (m.group("file"), int(m.group("line")))


def user_stack(n: torch.fx.Node) -> tuple[str, ...]:
    """``path:line: code`` of every user frame of node ``n``'s recorded stack, outermost first.

    What an eager traceback would show of the user's code (the compile error carries it as a note).
    """
    out = []
    for m in _FRAME.finditer(n.meta.get("stack_trace") or ""):
        if is_user_file(m.group("file")):
            line = int(m.group("line"))
            out.append(f"{m.group('file')}:{line}: {linecache.getline(m.group('file'), line).strip()}")
    return tuple(out)


def eager_method(n: torch.fx.Node, method: str) -> str:
    """The method eager checks for node ``n``'s ``method``: its operator dunder if the user wrote an operator."""
    inplace = method.endswith("_") and method[:-1] in _DUNDERS
    core = method[:-1] if inplace else method
    if core not in _DUNDERS:
        return method
    m = _user_frame(n)
    if m is None:
        return method
    rest = m.group("rest").split("\n")
    if len(rest) < 2 or "^" not in rest[1]:
        return method
    path, line = m.group("file"), int(m.group("line"))
    source = linecache.getline(path, line)
    col = (len(source) - len(source.lstrip())) + rest[1].index("^") - 4
    written = _operators(path).get((line, col), ())
    if core not in written:
        return method
    return f"__{'i' if inplace else ''}{_DUNDERS[core]}__"


@functools.lru_cache(maxsize=64)
def _operators(path: str) -> dict[tuple[int, int], tuple[str, ...]]:
    """(line, column) -> the tensor method names of the operators that start there in file ``path``."""
    try:
        tree = ast.parse("".join(linecache.getlines(path)))
    except (SyntaxError, ValueError):
        return {}
    found: dict[tuple[int, int], tuple[str, ...]] = {}

    def add(node: ast.AST, name: str | None) -> None:
        if name is not None:
            key = (node.lineno, node.col_offset)
            found[key] = found.get(key, ()) + (name,)

    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp):
            add(node, _BINOPS.get(type(node.op)))
        elif isinstance(node, ast.AugAssign):
            add(node, _BINOPS.get(type(node.op)))
        elif isinstance(node, ast.Compare) and len(node.ops) == 1:
            add(node, _COMPARES.get(type(node.ops[0])))
    return found
