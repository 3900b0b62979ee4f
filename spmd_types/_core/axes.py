"""A mesh axis as a region of ranks: the identity of an axis across meshes and process groups.

Two process groups, or two mesh dims, are the same axis when they run over
ranks laid out the same way (relative to their first rank): ``tp`` on ranks
{0, 1} and on {2, 3} are one axis, ``dp`` on {0, 2} another. A region is kept
as mixed-radix *atoms* ``(size, stride)``, coalesced and sorted by stride, so
that equal regions compare equal however they were built (a flattened
``dp_cp`` group equals the flattening of ``dp`` and ``cp``). Regions that no
mixed-radix layout describes keep their rank set.

Example::

    >>> MeshAxis.of(4, 1) == MeshAxis.from_ranks([4, 5, 6, 7])
    True
    >>> flatten([MeshAxis.of(2, 4), MeshAxis.of(4, 1)]) == MeshAxis.of(8, 1)
    True
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Iterable, Sequence

from .._torch.private import flat_layout_class

__all__ = ["MeshAxis", "flatten", "region_of_group", "orthogonal"]

Atoms = tuple[tuple[int, int], ...]


def _coalesce(atoms: Iterable[tuple[int, int]]) -> Atoms:
    """Sort by stride, drop size-1 atoms, merge an atom into the previous one when it continues it."""
    out: list[tuple[int, int]] = []
    for size, stride in sorted((a for a in atoms if a[0] > 1), key=lambda a: a[1]):
        if out and out[-1][0] * out[-1][1] == stride:
            out[-1] = (out[-1][0] * size, out[-1][1])
        else:
            out.append((size, stride))
    return tuple(out)


def _atoms_of_ranks(zero_based: Sequence[int]) -> Atoms | None:
    """The mixed-radix atoms generating these ranks (0 first), or None if no such layout does."""
    wanted = set(zero_based)
    covered = [0]
    atoms: list[tuple[int, int]] = []
    while len(covered) < len(wanted):
        have = set(covered)
        stride = min(r for r in wanted if r not in have)
        size = 1
        while all(c + size * stride in wanted for c in covered):
            size += 1
        if size == 1:  # the next rank does not extend every covered rank: no mixed-radix layout
            return None
        atoms.append((size, stride))
        covered = [c + j * stride for j in range(size) for c in covered]
        if len(set(covered)) != len(covered) or not set(covered) <= wanted:
            return None
    return _coalesce(atoms)


class MeshAxis:
    """A region of ranks that a mesh axis (or a process group) runs over, independent of its name.

    Equal regions are the same axis: types keyed by a name, a ``ProcessGroup``
    or a ``MeshAxis`` all resolve to the axis of the current mesh with this
    region. ``size()`` is the number of ranks; ``names`` the names meshes gave it.

    Example::

        >>> tp = MeshAxis.of(4, 1)
        >>> tp.size(), MeshAxis.of(2, 4).isorthogonal(tp)
        (4, True)
    """

    __slots__ = ("atoms", "_ranks", "__weakref__")

    def __init__(self, atoms: Atoms | None, ranks: frozenset[int] | None = None) -> None:
        object.__setattr__(self, "atoms", atoms)
        object.__setattr__(self, "_ranks", ranks)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("a MeshAxis is immutable")

    @staticmethod
    def of(size_or_group: Any, stride: int | None = None) -> MeshAxis:
        """``MeshAxis.of(size, stride)`` (ranks 0, stride, 2*stride, ...) or ``MeshAxis.of(process_group)``."""
        if isinstance(size_or_group, int) and not isinstance(size_or_group, bool):
            if stride is None or size_or_group < 1 or stride < 1:
                raise ValueError(f"MeshAxis.of(size, stride) needs a size >= 1 and a stride >= 1, got "
                                 f"{size_or_group!r}, {stride!r}")
            return MeshAxis(_coalesce([(size_or_group, stride)]))
        if stride is not None:
            raise TypeError("MeshAxis.of(process_group) takes no stride")
        return region_of_group(size_or_group)

    @staticmethod
    def from_ranks(ranks: Iterable[int]) -> MeshAxis:
        """The region of these global ranks (their layout relative to the smallest)."""
        ordered = sorted(set(int(r) for r in ranks))
        if not ordered:
            raise ValueError("a mesh axis has at least one rank")
        zero = [r - ordered[0] for r in ordered]
        atoms = _atoms_of_ranks(zero)
        return MeshAxis(atoms, None if atoms is not None else frozenset(zero))

    def size(self) -> int:
        """The number of ranks."""
        if self.atoms is None:
            return len(self._ranks)  # type: ignore[arg-type]
        n = 1
        for size, _ in self.atoms:
            n *= size
        return n

    def ranks(self) -> frozenset[int]:
        """The ranks relative to the first (``{0, 1, 2, 3}`` for ``MeshAxis.of(4, 1)``)."""
        if self.atoms is None:
            return self._ranks  # type: ignore[return-value]
        out = [0]
        for size, stride in self.atoms:
            out = [r + j * stride for j in range(size) for r in out]
        return frozenset(out)

    def outer_stride(self) -> int:
        """The largest stride (the outermost mesh dim this region spans); 0 for one rank."""
        if self.atoms is None:
            return max(self._ranks)  # type: ignore[arg-type]
        return max((s for _, s in self.atoms), default=0)

    def isorthogonal(self, *others: MeshAxis) -> bool:
        """True when these regions are independent dims of one mesh (their flattening is a region)."""
        return orthogonal((self,) + others)

    def __le__(self, other: MeshAxis) -> bool:
        if not isinstance(other, MeshAxis):
            return NotImplemented
        return self.ranks() <= other.ranks()

    def __lt__(self, other: MeshAxis) -> bool:
        if not isinstance(other, MeshAxis):
            return NotImplemented
        return self != other and self <= other

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MeshAxis):
            return NotImplemented
        return self.atoms == other.atoms and self._ranks == other._ranks

    def __hash__(self) -> int:
        return hash((self.atoms, self._ranks))

    @property
    def names(self) -> frozenset[str]:
        """The names meshes and process groups (their ``group_desc``) gave this region (may be empty)."""
        return frozenset(_NAMES.get(self, ()))

    @property
    def layout(self) -> Any:
        """The published API's layout: torch's ``_FlatLayout`` of this region (``.shape``, ``.stride``,
        ``all_ranks_from_zero()``, ``numel()``); calling it gives :meth:`layout_str`'s text."""
        return _layout_of(self)

    def layout_str(self) -> str:
        """``'4:1'``, ``'(2,2):(4,1)'``: sizes and strides, outermost first."""
        if self.atoms is None:
            return "{" + ",".join(str(r) for r in sorted(self._ranks)) + "}"  # type: ignore[arg-type]
        if not self.atoms:
            return "1:1"
        atoms = self.atoms[::-1]
        if len(atoms) == 1:
            return f"{atoms[0][0]}:{atoms[0][1]}"
        return "(" + ",".join(str(s) for s, _ in atoms) + "):(" + ",".join(str(d) for _, d in atoms) + ")"

    def __repr__(self) -> str:
        name = CURRENT_NAME[0](self)  # the innermost current mesh's name for it, if it has one
        if name is None:
            names = _NAMES.get(self)
            name = names[-1] if names else None  # else the name a mesh gave it last
        return name if name is not None else f"MeshAxis({self.layout_str()})"


def _layout_class() -> Any:
    if not _LAYOUT_CLASS:
        class AxisLayout(flat_layout_class()):  # type: ignore[misc]
            """torch's layout of a region; ``layout()`` is its short text (``'4:1'``)."""

            text = ""
            ranks: Any = None

            def __call__(self) -> str:
                return self.text

            def all_ranks_from_zero(self) -> Any:
                return list(self.ranks) if self.ranks is not None else super().all_ranks_from_zero()

        _LAYOUT_CLASS.append(AxisLayout)
    return _LAYOUT_CLASS[0]


_LAYOUT_CLASS: list = []


def _layout_of(region: MeshAxis) -> Any:
    cls = _layout_class()
    if region.atoms is None:  # no sizes and strides describe it: one dim over its ranks
        layout = cls((region.size(),), (1,))
        layout.ranks = sorted(region.ranks())
    else:
        atoms = region.atoms[::-1] or ((1, 1),)
        layout = cls(tuple(s for s, _ in atoms), tuple(d for _, d in atoms))
    layout.text = region.layout_str()
    return layout


def orthogonal(axes: Sequence[MeshAxis]) -> bool:
    """True when the regions are independent mixed-radix dims: each stride lies past the span of the smaller ones."""
    atoms: list[tuple[int, int]] = []
    for a in axes:
        if a.atoms is None:
            return len([b for b in axes if b.size() > 1]) <= 1
        atoms.extend(a.atoms)
    span = 0
    for size, stride in sorted(atoms, key=lambda x: x[1]):
        if stride <= span:
            return False
        span += (size - 1) * stride
    return True


def flatten(axes: Sequence[MeshAxis]) -> MeshAxis:
    """The region of several orthogonal axes taken together (a flattened group over them)."""
    if not orthogonal(axes):
        raise ValueError("cannot flatten axes that are not independent dims of one mesh: "
                         + ", ".join(a.layout_str() for a in axes))
    if any(a.atoms is None for a in axes):
        big = [a for a in axes if a.size() > 1]
        return big[0] if big else MeshAxis(())
    return MeshAxis(_coalesce(itertools.chain.from_iterable(a.atoms for a in axes)))  # type: ignore[arg-type]


# names for display, from the meshes that named each region (most recent last)
_NAMES: dict[MeshAxis, list[str]] = {}
# how the current mesh names a region (set by _core/mesh.py, which knows the current mesh)
CURRENT_NAME: list = [lambda region: None]
_GROUP_REGIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# group_desc names (name -> the regions that claimed it), and the names two regions claimed
_FROM_GROUPS: dict[str, set] = {}
_CLASHED: set[str] = set()


def name_region(region: MeshAxis, name: str) -> None:
    """Remember that a mesh called ``region`` ``name`` (for ``repr``)."""
    if region.size() > 1:
        names = _NAMES.setdefault(region, [])
        if name in names:
            names.remove(name)
        names.append(name)


def name_from_group(region: MeshAxis, name: str) -> None:
    """Remember a process group's ``group_desc`` as a name of its region, after any name a mesh gave it.

    A name that two regions claim gets each region's layout as a suffix
    (``mesh_ddp[8:1]``, ``mesh_ddp[4:1]``), and so does every later claim of it.
    """
    if region.size() <= 1 or name == "undefined":
        return
    if name in _CLASHED:
        name = f"{name}[{region.layout_str()}]"
    else:
        for other, names in _NAMES.items():
            if other != region and name in names and other in _FROM_GROUPS.get(name, ()):
                _CLASHED.add(name)
                names[names.index(name)] = f"{name}[{other.layout_str()}]"
                name = f"{name}[{region.layout_str()}]"
                break
    names = _NAMES.setdefault(region, [])
    if name not in names:
        names.insert(0, name)  # a mesh's own name for the region is shown first
    _FROM_GROUPS.setdefault(name, set()).add(region)


def region_of_group(group: Any) -> MeshAxis:
    """The region a ProcessGroup runs over (cached per group); an object with ``__mesh_axis__()`` gives its own."""
    try:
        found = _GROUP_REGIONS.get(group)
    except TypeError:  # not weak-referenceable: not a group, nor cached
        found = None
    if found is not None:
        return found
    own = getattr(group, "__mesh_axis__", None)
    if own is not None:
        region = own()
        if not isinstance(region, MeshAxis):
            raise TypeError(f"{type(group).__name__}.__mesh_axis__() must return a MeshAxis, got {region!r}")
    else:
        import torch.distributed as dist

        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"expected a ProcessGroup, got {type(group).__name__}")
        region = MeshAxis.from_ranks(dist.get_process_group_ranks(group))
        desc = getattr(group, "group_desc", None)
        if isinstance(desc, str) and desc:
            name_from_group(region, desc)
    try:
        _GROUP_REGIONS[group] = region
    except TypeError:  # not weak-referenceable: not cached
        pass
    return region
