"""Shard propagation for global SPMD, as data: op family -> rule, each with a one-line reason.

:func:`propagate` is the one entry point: it collects the operands' partition
specs on the axes checked in global SPMD, finds the op's row, and returns the
result's spec or raises ``SpmdTypeError`` naming the communication needed.
An op with no row is accepted only when no operand is sharded.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .._core.errors import DTensorPropagationError, Rejection, SpmdTypeError, op_error
from .._core.spec import Spec, check_placement
from .._core.types import TypeMap
from .._local.op_registry import _resolve, entry_for
from .._local.rules_table import op_variants
from .shard_contract import attention_rule, cross_entropy_rule, einsum_rule, embedding_rule, linear_rule, matmul_rule
from .shard_props import Ctx, Operand, PendingSum, along_dim, normalize_last, reduction, same
from .shard_shapes import (
    complex_view_rule,
    concat_rule,
    expand_rule,
    gather_rule,
    index_rule,
    permute_rule,
    reshape_rule,
    scatter_rule,
    select_rule,
    split_rule,
    squeeze_rule,
    stack_rule,
    transpose_rule,
    unsqueeze_rule,
)

__all__ = ["ShardKind", "SHARD_ROWS", "propagate"]


class ShardKind(enum.Enum):
    ELEMENTWISE = "elementwise"
    LINEAR_REDUCTION = "linear reduction"
    REDUCTION = "reduction"
    ALONG_DIM = "along one dim"
    NORMALIZE = "normalize trailing dims"
    CONTRACTION = "contraction"
    RESHAPE = "reshape"
    PERMUTE = "permute"
    CONCAT = "concatenate"
    SPLIT = "split"
    SELECT = "select"
    INDEX = "index"
    RESIZE = "add or drop dims"
    EMBEDDING = "embedding"
    ATTENTION = "attention"
    LOSS = "loss"


@dataclass(frozen=True)
class ShardRow:
    names: tuple[str, ...]
    kind: ShardKind
    rule: Callable[[Ctx], Spec | Rejection]
    reason: str


# The usual spellings of each op: torch.X, Tensor.X and Tensor.X_ (shared with the rules table).
_v = op_variants


_POINTWISE = _v(
    "add", "sub", "subtract", "mul", "multiply", "div", "divide", "true_divide", "rsub", "neg", "negative",
    "pow", "float_power", "square", "abs", "sign", "reciprocal", "exp", "exp2", "expm1", "log", "log2", "log10",
    "log1p", "sqrt", "rsqrt", "sin", "cos", "tan", "tanh", "sigmoid", "erf", "floor", "ceil", "round", "trunc",
    "clamp", "clip", "clamp_min", "clamp_max", "maximum", "minimum", "relu", "nan_to_num", "lerp", "hypot",
    "atan2", "remainder", "fmod", "floor_divide", "addcmul", "addcdiv", "where", "masked_fill", "eq", "ne",
    "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not", "isnan", "isinf", "isfinite",
    "clone", "contiguous", "detach", "float", "half", "bfloat16", "double", "int", "long", "bool", "to",
    "type_as", "requires_grad", "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
) + tuple(f"Tensor.__{d}__" for d in (
    "add", "radd", "iadd", "sub", "rsub", "isub", "mul", "rmul", "imul", "truediv", "rtruediv", "itruediv",
    "pow", "rpow", "neg", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "invert", "floordiv", "mod", "abs",
)) + ("Tensor.data", "F.gelu", "F.silu", "F.relu", "F.leaky_relu", "F.elu", "F.softplus", "F.mish", "F.sigmoid",
      "F.tanh", "F.dropout", "F.hardtanh", "F.logsigmoid", "torch.dropout")

SHARD_ROWS: tuple[ShardRow, ...] = (
    ShardRow(_POINTWISE, ShardKind.ELEMENTWISE, same,
             "pointwise on broadcast operands: each rank's block of the result needs the same block of every operand"),
    ShardRow(_v("sum", "nansum"), ShardKind.LINEAR_REDUCTION, functools.partial(reduction, linear=True),
             "a sum over a sharded dim is a pending sum: asked for with spmd.sum(..., out_partial_axes=)"),
    ShardRow(_v("mean", "amax", "amin", "max", "min", "prod", "std", "var", "norm", "logsumexp", "argmax",
                "argmin", "any", "all", "count_nonzero", "nanmean", "median") + ("torch.linalg.vector_norm",),
             ShardKind.REDUCTION, functools.partial(reduction, linear=False),
             "a non-sum reduction over a sharded dim needs the whole dim on one rank"),
    ShardRow(_v("softmax", "log_softmax", "cumsum", "cumprod", "logcumsumexp", "sort", "argsort")
             + ("F.softmax", "F.log_softmax"), ShardKind.ALONG_DIM, along_dim,
             "mixes values along one dim, which must be whole on every rank"),
    ShardRow(_v("topk"), ShardKind.ALONG_DIM, functools.partial(along_dim, index=2),
             "selects along one dim, which must be whole on every rank"),
    ShardRow(("F.normalize",), ShardKind.ALONG_DIM, functools.partial(along_dim, index=2, default=1),
             "normalizes along one dim, which must be whole on every rank"),
    ShardRow(("F.layer_norm", "F.rms_norm"), ShardKind.NORMALIZE, normalize_last,
             "statistics over the trailing dims, which must be whole on every rank"),
    ShardRow(_v("matmul", "mm", "bmm", "mv", "dot") + ("Tensor.__matmul__",), ShardKind.CONTRACTION, matmul_rule,
             "an einsum: no contracted dim sharded (unless out_partial_axes), output dims sharded as in the operands"),
    ShardRow(("Tensor.__rmatmul__",), ShardKind.CONTRACTION, lambda ctx: matmul_rule(_reversed(ctx)),
             "a @ b written b.__rmatmul__(a): the einsum rule on (a, b)"),
    ShardRow(("torch.einsum",), ShardKind.CONTRACTION, einsum_rule, "seed 003's three einsum conditions"),
    ShardRow(("F.linear",), ShardKind.CONTRACTION, linear_rule,
             "x @ w.T: the einsum rule, and the bias sharded like the output features"),
    ShardRow(_v("view", "reshape", "flatten", "unflatten", "view_as", "reshape_as", "ravel"), ShardKind.RESHAPE,
             reshape_rule, "a sharded dim survives a reshape as the major dim of the dims it merges or splits into"),
    ShardRow(_v("permute"), ShardKind.PERMUTE, permute_rule, "the spec is permuted with the dims"),
    ShardRow(_v("transpose", "swapaxes", "swapdims", "t", "movedim", "moveaxis") + ("Tensor.T", "Tensor.mT"),
             ShardKind.PERMUTE, transpose_rule, "the spec is permuted with the dims"),
    ShardRow(_v("cat", "concat", "concatenate"), ShardKind.CONCAT, concat_rule,
             "inputs sharded alike, concatenated along an unsharded dim"),
    ShardRow(_v("stack"), ShardKind.CONCAT, stack_rule, "inputs sharded alike; the new dim is unsharded"),
    ShardRow(_v("split", "chunk", "unbind", "tensor_split", "split_with_sizes"), ShardKind.SPLIT, split_rule,
             "split along an unsharded dim; every piece keeps the layout"),
    ShardRow(_v("select", "narrow", "index_select"), ShardKind.SELECT, select_rule,
             "select along an unsharded dim"),
    ShardRow(_v("gather", "take_along_dim", inplace=False), ShardKind.SELECT, gather_rule,
             "the index's layout; input and index sharded alike off the gathered dim, which is whole in the input"),
    ShardRow(_v("scatter", "scatter_add", "scatter_reduce"), ShardKind.SELECT, scatter_rule,
             "the input's layout; index and values sharded like it off the scattered dim, which is whole"),
    ShardRow(("Tensor.__getitem__",), ShardKind.INDEX, index_rule,
             "full slices keep a dim's sharding; any other index must hit an unsharded dim"),
    ShardRow(_v("unsqueeze"), ShardKind.RESIZE, unsqueeze_rule, "a new dim is unsharded"),
    ShardRow(_v("squeeze"), ShardKind.RESIZE, squeeze_rule, "only unsharded size-1 dims can be dropped"),
    ShardRow(_v("view_as_complex", "view_as_real"), ShardKind.RESIZE, complex_view_rule,
             "the last dim of reals is the (real, imaginary) pair of one complex value: it stays whole"),
    ShardRow(_v("expand", "expand_as", "repeat", "broadcast_to"), ShardKind.RESIZE, expand_rule,
             "only unsharded dims can grow; new leading dims are unsharded"),
    ShardRow(("F.embedding",), ShardKind.EMBEDDING, embedding_rule,
             "look-ups keep the indices' layout; the vocabulary dim must be whole"),
    ShardRow(("F.scaled_dot_product_attention",), ShardKind.ATTENTION, attention_rule,
             "heads and batch sharded alike in q, k, v; key length and head size whole"),
    ShardRow(("F.cross_entropy",), ShardKind.LOSS, cross_entropy_rule,
             "classes whole; a mean over a sharded batch must be asked for explicitly"),
)


def _reversed(ctx: Ctx) -> Ctx:
    ctx.operands = list(reversed(ctx.operands))
    return ctx


def _build() -> dict[Any, ShardRow]:
    table: dict[Any, ShardRow] = {}
    for row in SHARD_ROWS:
        for raw in row.names:
            func, _ = _resolve(raw.lstrip("?"))
            if func is None:
                if not raw.startswith("?"):
                    raise AssertionError(f"{raw} is not a torch callable")
                continue
            table.setdefault(func, row)
    return table


SHARD_TABLE = _build()


# ---------------------------------------------------------------------------


def _operands(entry_params: tuple[str, ...], args, kwargs, global_axes: frozenset[str]) -> list[Operand]:
    found: list[tuple[str, torch.Tensor]] = []
    for i, a in enumerate(args):
        name = entry_params[i] if i < len(entry_params) and not entry_params[i].startswith("*") else f"arg{i}"
        if isinstance(a, torch.Tensor):
            found.append((name, a))
        elif isinstance(a, (list, tuple)):
            found.extend((f"{name}[{j}]", t) for j, t in enumerate(a) if isinstance(t, torch.Tensor))
    found.extend((k, v) for k, v in kwargs.items() if isinstance(v, torch.Tensor) and k != "out")
    return [Operand(label, t, _spec_of(t, label, global_axes)) for label, t in found]


def _spec_of(t: torch.Tensor, label: str, global_axes: frozenset[str]) -> Spec:
    spec = getattr(t, "_spmd_spec", None)
    if spec is None:
        types: TypeMap | None = getattr(t, "_spmd_types", None)
        if types is not None:
            why = check_placement(types, tuple(() for _ in range(t.dim())), global_axes)
            if why:
                raise op_error(Rejection(f"Global SPMD: {label} has no layout: {why}.", [], [
                    f"spmd.assert_type({label}, {{...}}, partition_spec=...)"]), "", ())
        return tuple(() for _ in range(t.dim()))
    return tuple(tuple(a for a in e if a in global_axes) for e in spec)


_SPEC_CACHE: dict[Any, Spec | None] = {}
_SPEC_CACHE_LIMIT = 1 << 16
_MISSING = object()


def _key_part(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return (getattr(v, "_spmd_spec", None), tuple(v.shape), getattr(v, "_spmd_types", None))
    if isinstance(v, (list, tuple)):
        return tuple([_key_part(x) for x in v])
    if isinstance(v, slice):
        return ("slice", _key_part(v.start), _key_part(v.stop), _key_part(v.step))
    return v


def propagate(func, args, kwargs, out, out_types: TypeMap | None, global_axes: frozenset[str],
              sizes: dict[str, int], partial: frozenset[str]) -> Spec | None:
    """The partition spec of ``func``'s result on ``global_axes``, or raise naming the comm needed.

    Call with torch-function subclass dispatch off (shapes are read directly).
    Results are cached by op, operand specs, types and shapes, and the other
    arguments; a call whose arguments are not hashable is not cached.
    """
    key: Any = (func, _key_part(args), tuple([(k, _key_part(v)) for k, v in kwargs.items()]) if kwargs else (),
                global_axes, partial)
    try:
        found = _SPEC_CACHE.get(key, _MISSING)
    except TypeError:
        key, found = None, _MISSING
    if found is not _MISSING:
        return found
    spec = _propagate(func, args, kwargs, out, out_types, global_axes, sizes, partial)
    if key is not None:
        if len(_SPEC_CACHE) >= _SPEC_CACHE_LIMIT:  # keys hold shapes: varying sequence lengths add up
            _SPEC_CACHE.clear()
        _SPEC_CACHE[key] = spec
    return spec


PENDING = object()  # the op has not run (it failed): rules that need its result cannot say


def raise_pending(func, spec: PendingSum) -> None:
    """Raise the error a contraction over a sharded dim gets when it cannot be a pending sum."""
    entry = entry_for(func)
    raise op_error(spec, getattr(func, "__name__", ""), entry.row.params)


def explain_failure(func, args, kwargs, out_types, global_axes, sizes, partial) -> None:
    """When the local op itself failed, raise the SpmdTypeError its shard rule gives, if any.

    A layout mistake often makes the local op fail first (global class ids on a
    class-sharded logit, a global shape on a local shard); the rule's message
    names the fix, where torch's only says what broke.
    """
    try:
        _propagate(func, args, kwargs, PENDING, out_types, global_axes, sizes, partial)
    except SpmdTypeError:
        raise
    except Exception:  # the rule needs the result; let torch's own error stand
        return


def _propagate(func, args, kwargs, out, out_types, global_axes, sizes, partial) -> Spec | None:
    is_tensors = isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor)
    if out is not PENDING and not isinstance(out, torch.Tensor) and not is_tensors:
        return None
    entry = entry_for(func)
    operands = _operands(entry.row.params, args, kwargs, global_axes)
    ctx = Ctx(entry.display, args, kwargs, operands, sizes, out, partial)
    if not any(any(op.spec) for op in operands):
        spec: Spec | Rejection = tuple(() for _ in range(ctx.out_ndim()))
    else:
        row = SHARD_TABLE.get(func)
        if row is None:
            spec = ctx.reject(
                f"{entry.display} has no shard propagation rule, and an operand is sharded.",
                "global SPMD accepts an op only where a rule says how the shards line up",
                ["spmd.local_map the code that calls it (local SPMD inside)", "all_gather the sharded operand first"],
            )
        else:
            spec = row.rule(ctx)
    if isinstance(spec, PendingSum) and out is not PENDING:
        return spec  # the caller decides: a pending sum, or this error (raise_pending)
    if isinstance(spec, Rejection):  # no rule gives the result's layout
        raise op_error(spec, getattr(func, "__name__", ""), entry.row.params, DTensorPropagationError)
    if out_types is not None and out is not PENDING:
        why = check_placement(out_types, spec, global_axes - partial)
        if why:
            raise op_error(ctx.reject(f"{entry.display}'s result has no layout.", why, []), "", ())
    return spec
