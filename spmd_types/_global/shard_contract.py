"""Shard propagation for contractions (einsum, matmul, linear), embedding, attention and the loss.

The einsum rule is seed 003's three conditions: (1) no contracted label is
sharded, unless the call asked for a pending sum on those axes with
``out_partial_axes``; (2) an output label sharded on an axis is sharded on it
in every operand that uses the label; (3) no mesh axis shards two dims.
"""

from __future__ import annotations

import string

from .._core.errors import Rejection
from .._core.spec import Spec
from .shard_props import Ctx, Operand, PendingSum, _axes, _tuple_code, gather_fix

__all__ = ["einsum_rule", "matmul_rule", "linear_rule", "embedding_rule", "attention_rule", "cross_entropy_rule"]


def _contract(ctx: Ctx, labelled: list[tuple[Operand, str]], out_labels: str) -> Spec | Rejection:
    by_label: dict[str, tuple[tuple[str, ...], Operand, int]] = {}
    for op, labels in labelled:
        for d, label in enumerate(labels):
            entry = op.spec[d]
            if op.tensor.shape[d] == 1 and not entry:
                continue  # broadcast dim
            seen = by_label.get(label)
            if seen is None:
                by_label[label] = (entry, op, d)
            elif seen[0] != entry:
                sharded = (entry, op, d) if entry else seen
                return ctx.reject(
                    "every operand that uses an index must shard it the same way.",
                    f"index '{label}' is sharded on {_axes(seen[0])} in {seen[1].label} "
                    f"but on {_axes(entry)} in {op.label}",
                    [gather_fix(sharded[1].label, sharded[0], sharded[2])],
                )
    partial: list[str] = []
    for label, (entry, op, d) in by_label.items():
        if label in out_labels or not entry:
            continue
        missing = [a for a in entry if a not in ctx.partial]
        if missing:
            fix = f"{_explicit_partial_op(ctx.display)}(..., out_partial_axes={_tuple_code(list(entry))})"
            found = ctx.reject(
                "a contraction over a sharded dim gives each rank a partial sum; ask for it explicitly.",
                f"contracted index '{label}' (dim {d} of {op.label}) is sharded on {_axes(entry)}",
                [fix, gather_fix(op.label, entry, d)],
            )
            return PendingSum(found.rule, found.seen, found.fixes, found.notes, tuple(entry))
        partial.extend(entry)
    out = tuple(by_label.get(label, ((),))[0] for label in out_labels)
    used = [a for entry in out for a in entry] + partial
    repeated = sorted({a for a in used if used.count(a) > 1})
    if repeated:
        return ctx.reject(
            "a mesh axis can shard only one dim of the result.",
            f"axis {_axes(tuple(repeated))} would shard two dims of the result",
            [gather_fix(labelled[-1][0].label, tuple(repeated), 0)],
        )
    return out


def _explicit_partial_op(display: str) -> str:
    for name in ("linear", "einsum"):
        if name in display:
            return f"spmd.{name}"
    return "spmd.matmul"


def einsum_rule(ctx: Ctx) -> Spec | Rejection:
    equation = ctx.args[0].replace(" ", "")
    if "..." in equation:
        return ctx.reject("einsum with '...' has no shard propagation rule yet.", equation,
                          ["spell out every index of the equation"])
    inputs, _, out_labels = equation.partition("->")
    parts = inputs.split(",")
    if not _:
        counts = {c: inputs.count(c) for c in inputs if c.isalpha()}
        out_labels = "".join(sorted(c for c, n in counts.items() if n == 1))
    return _contract(ctx, list(zip(ctx.operands, parts)), out_labels)


def matmul_rule(ctx: Ctx) -> Spec | Rejection:
    """matmul / mm / bmm / mv / dot as an einsum: batch dims broadcast, '...m k, ...k n -> ...m n'."""
    a, b = ctx.operands[0], ctx.operands[1]
    na, nb = a.tensor.dim(), b.tensor.dim()
    batch = max(na, nb) - 2 if na >= 2 and nb >= 2 else max(na, nb) - 1 if min(na, nb) == 1 and max(na, nb) > 2 else 0
    letters = string.ascii_lowercase[:batch]
    la = (letters[batch - (na - 2):] if na > 2 else "") + ("mk" if na >= 2 else "k")
    lb = (letters[batch - (nb - 2):] if nb > 2 else "") + ("kn" if nb >= 2 else "k")
    out = letters + ("m" if na >= 2 else "") + ("n" if nb >= 2 else "")
    return _contract(ctx, [(a, la), (b, lb)], out)


def linear_rule(ctx: Ctx) -> Spec | Rejection:
    """x[..., k] @ w[n, k].T + b[n]."""
    x, w = ctx.operands[0], ctx.operands[1]
    batch = "abcdefgh"[: x.tensor.dim() - 1]
    result = _contract(ctx, [(x, batch + "k"), (w, "nk")], batch + "n")
    if isinstance(result, Rejection) or len(ctx.operands) < 3:
        return result
    bias = ctx.operands[2]
    if bias.spec and bias.spec[-1] != result[-1]:
        return ctx.reject(
            "the bias must be sharded like the output features it is added to.",
            f"output features are sharded on {_axes(result[-1])}, {bias.label} on {_axes(bias.spec[-1])}",
            [gather_fix(bias.label, bias.spec[-1], 0)] if bias.spec[-1] else [],
        )
    return result


def embedding_rule(ctx: Ctx) -> Spec | Rejection:
    """embedding(idx, weight[V, D]) -> [*idx, D]: the vocabulary dim must be unsharded."""
    idx, weight = ctx.operands[0], ctx.operands[1]
    if weight.spec[0]:
        return ctx.reject(
            "a vocabulary-sharded embedding needs masking and a sum over the shards.",
            f"dim 0 of {weight.label} is sharded on {_axes(weight.spec[0])}",
            ["spmd.local_map a vocabulary-parallel embedding (mask, look up, then all_reduce)",
             gather_fix(weight.label, weight.spec[0], 0)],
        )
    return idx.spec + (weight.spec[1],)


def attention_rule(ctx: Ctx) -> Spec | Rejection:
    """sdpa(q, k, v): batch and head dims sharded alike; key length and head size unsharded."""
    q, k, v = ctx.operands[0], ctx.operands[1], ctx.operands[2]
    if not (q.spec[:-2] == k.spec[:-2] == v.spec[:-2]):
        return ctx.reject(
            "query, key and value must shard their batch and head dims the same way.",
            f"{q.label} {q.spec[:-2]}, {k.label} {k.spec[:-2]}, {v.label} {v.spec[:-2]}",
            [],
        )
    for op, dims in ((q, (-1,)), (k, (-2, -1)), (v, (-2, -1))):
        for d in dims:
            if op.spec[d]:
                return ctx.reject(
                    "attention needs the whole key sequence and head size on every rank.",
                    f"dim {d} of {op.label} is sharded on {_axes(op.spec[d])}",
                    [gather_fix(op.label, op.spec[d], op.tensor.dim() + d)],
                )
    for extra in ctx.operands[3:]:
        if any(extra.spec):
            return ctx.reject("the attention mask must be unsharded.", f"{extra.label} is sharded", [])
    return q.spec[:-1] + (v.spec[-1],)


def cross_entropy_rule(ctx: Ctx) -> Spec | Rejection:
    """cross_entropy(logits[N, C], target[N]): classes unsharded; a mean or sum over a sharded batch is explicit."""
    logits = ctx.operands[0]
    class_dim = 1 if logits.tensor.dim() >= 2 else 0
    if logits.spec[class_dim]:
        return ctx.reject(
            "a class-sharded cross-entropy needs a max and a sum over the shards.",
            f"class dim {class_dim} of {logits.label} is sharded on {_axes(logits.spec[class_dim])}",
            ["spmd.local_map a vocabulary-parallel cross-entropy", gather_fix(logits.label, logits.spec[class_dim], class_dim)],
        )
    per_item = tuple(e for d, e in enumerate(logits.spec) if d != class_dim)
    reduction = ctx.arg(7, "reduction", "mean")
    if reduction == "none":
        return per_item
    sharded = [a for e in per_item for a in e]
    if sharded:
        return ctx.reject(
            f"reduction='{reduction}' over a sharded batch reduces only this rank's items.",
            f"the batch is sharded on {_axes(tuple(sharded))}",
            [f"F.cross_entropy(..., reduction='none'), then spmd.sum(loss, 0, out_partial_axes={_tuple_code(sharded)})"],
        )
    return ()
