"""Moving a type from one presentation of the ranks to another (``reinterpret_mesh``), as data on regions.

The same ranks can be presented as different meshes: a dense ``(dp, cp, tp)``
and an expert ``(edp, ep, etp)``, or ``(dp, cp)`` and one flattened ``dp_cp``.
A type moves between two presentations when:

* an axis whose region is in both keeps its type (under the target's name);
* the remaining axes of each side, taken outermost first, split into groups
  whose flattenings are the same region, and every axis of a source group has
  the same type, which each axis of the matching target group then gets
  (``(dp: V, cp: V)`` -> ``dp_cp: V``; ``(dp: R, cp: V)`` cannot flatten);
  varying types that differ only in layout (``(edp: V, ep: S(0))``) give V, the
  layout dropped (a shard is a varying value whose layout one axis alone knows).

Anything else is refused with the reason, never guessed.
"""

from __future__ import annotations

from typing import Any, Sequence

from .axes import MeshAxis, flatten
from .types import Space, SpmdType, TypeMap, V

__all__ = ["move_types", "move_spec", "rehome", "GroupMove"]

GroupMove = tuple[tuple[str, ...], tuple[str, ...]]  # (source names, target names), outermost first


def move_types(types: TypeMap, target: Space) -> tuple[TypeMap, Sequence[GroupMove]] | str:
    """``types`` on ``target``'s axes, with the groups that moved (not to be mutated); or why it cannot move.

    A pure function of two interned values (a type map and a space: the same object for the same content,
    never changed), so its answer is remembered per pair: an op on a tensor typed on the other mesh of an MoE
    layer asks it on every call.
    """
    source = types.space
    if source is None or source is target:
        return types, [(a, a) for a in ((n,) for n in types.axes())]
    key = (types, target)
    found = _MOVED.get(key)
    if found is None:
        found = _move_types(types, target)
        if not isinstance(found, str):
            found = (found[0], tuple(found[1]))
        if len(_MOVED) >= 4096:
            _MOVED.clear()
        _MOVED[key] = found
    return found


_MOVED: dict[tuple[TypeMap, Space], tuple[TypeMap, tuple[GroupMove, ...]] | str] = {}


def _move_types(types: TypeMap, target: Space) -> tuple[TypeMap, list[GroupMove]] | str:
    """:func:`move_types` worked out (``types`` on another space than ``target``)."""
    source = types.space
    by_region: dict[object, str] = {region: name for name, region in target.pairs}
    out: dict[str, SpmdType] = {}
    moves: list[GroupMove] = []
    rest_src: list[tuple[str, MeshAxis, SpmdType]] = []
    for name, t in types.items:
        region = source.region(name)
        if region in by_region:
            out[by_region[region]] = t
            moves.append(((name,), (by_region[region],)))
        else:
            rest_src.append((name, region, t))  # type: ignore[arg-type]
    rest_dst = [(n, r) for n, r in target.pairs if n not in out]
    if not rest_src and not rest_dst:
        return TypeMap.of(out, target), moves
    if not rest_dst:
        return (f"axes {_names(rest_src)} of the tensor's mesh have no counterpart in the target mesh "
                f"({', '.join(target.names())})")
    if not rest_src:
        return (f"the target mesh's axes {_names(rest_dst)} cover ranks the tensor's type says nothing about "
                f"(its axes: {', '.join(types.axes())})")
    walked = _walk(sorted(rest_src, key=_outer, reverse=True), sorted(rest_dst, key=_outer, reverse=True))
    if isinstance(walked, str):
        return walked
    for src_group, dst_group, t in walked:
        for name in dst_group:
            out[name] = t
        moves.append((src_group, dst_group))
    return TypeMap.of(out, target), moves


def _outer(entry: tuple) -> int:
    return entry[1].outer_stride()


def _names(entries: Sequence[tuple]) -> str:
    return "(" + ", ".join(e[0] for e in entries) + ")"


def _walk(src: list, dst: list) -> list[tuple[tuple[str, ...], tuple[str, ...], SpmdType]] | str:
    """Pair outermost-first groups of source and target axes whose flattenings are one region."""
    groups = []
    i = j = 0
    while i < len(src) or j < len(dst):
        sg, dg = [src[i]] if i < len(src) else [], [dst[j]] if j < len(dst) else []
        i, j = i + len(sg), j + len(dg)
        if not sg or not dg:
            return "the two meshes do not cover the same ranks: " + _leftover(src[i - len(sg):], dst[j - len(dg):])
        while _size(sg) != _size(dg):
            if _size(sg) < _size(dg) and i < len(src):
                sg.append(src[i])
                i += 1
            elif _size(dg) < _size(sg) and j < len(dst):
                dg.append(dst[j])
                j += 1
            else:
                return "the two meshes do not cover the same ranks: " + _leftover(sg, dg)
        kinds = {t for _, _, t in sg}
        kind = sg[0][2]
        if len(kinds) > 1 and all(t.is_varying for t in kinds):
            kind = V  # V and S(d) mixed: different on every rank of the group, with no one layout to keep
        elif len(kinds) > 1:
            shown = ", ".join(f"{n}: {t}" for n, _, t in sg)
            return (f"axes {_names(sg)} would flatten into {_names(dg)}, but their types differ ({shown}); "
                    "a flattened axis has one type")
        if flatten([r for _, r, _ in sg]) != flatten([r for _, r in dg]):
            return (f"axes {_names(sg)} and {_names(dg)} have the same size but run over different ranks "
                    f"({flatten([r for _, r, _ in sg]).layout_str()} vs {flatten([r for _, r in dg]).layout_str()})")
        groups.append((tuple(n for n, _, _ in sg), tuple(n for n, _ in dg), kind))
    return groups


def _size(group: list) -> int:
    n = 1
    for entry in group:
        n *= entry[1].size()
    return n


def _leftover(src: list, dst: list) -> str:
    return f"{_names(src) if src else '()'} against {_names(dst) if dst else '()'}"


def move_spec(spec: tuple, groups: Sequence[GroupMove]) -> tuple | str:
    """A partition spec (names per dim) with each moved group's axes renamed; or why it cannot move.

    A group's axes must appear together and in order on one dim (``(dp, cp)`` becomes
    ``(dp_cp,)``); a dim sharded on part of a group that moves as one has no name on
    the target mesh.
    """
    rename = dict(groups)
    out = []
    for entry in spec:
        names, i, new = list(entry), 0, []
        while i < len(names):
            for src, dst in rename.items():
                if tuple(names[i:i + len(src)]) == src:
                    new.extend(dst)
                    i += len(src)
                    break
            else:
                return (f"dim {len(out)} is sharded on {tuple(entry)}, which splits a group of axes that moves "
                        f"as one ({', '.join(f'{s} -> {d}' for s, d in rename.items() if len(s) + len(d) > 2)})")
        out.append(tuple(new))
    return tuple(out)


def rehome(t: Any, target: Space) -> str | None:
    """Store typed ``t``'s type and partition spec as presented on ``target``, in place; None, or why it cannot move.

    The meaning does not change (the same ranks, renamed and flattened), so the
    same object may carry either presentation.
    """
    types: TypeMap = t._spmd_types
    if types.space is None or types.space is target:
        return None
    found = move_types(types, target)
    if isinstance(found, str):
        return found
    moved, groups = found
    spec = getattr(t, "_spmd_spec", None)
    if spec is not None:
        new_spec = move_spec(spec, groups)
        if isinstance(new_spec, str):
            return new_spec
        t._spmd_spec = new_spec
    t._spmd_types = moved
    return None
