"""The type values: R, I, V, P and S(d), per-tensor type maps, cotangent duality.

Type values are small, immutable and canonical: ``S(0) is S(0)``. A tensor's
type is a :class:`TypeMap`, an interned mapping ``{axis_name: type}``; interning
makes it hashable by identity, which the per-op inference cache relies on.
"""

from __future__ import annotations

from typing import Iterable, Mapping

__all__ = [
    "SpmdType",
    "AxisType",
    "R",
    "I",
    "V",
    "P",
    "S",
    "Replicate",
    "Invariant",
    "Varying",
    "Partial",
    "Shard",
    "backward_type",
    "PartitionSpec",
    "TypeMap",
    "Space",
    "PerMeshAxisLocalSpmdType",
]


class SpmdType:
    """An SPMD type: one axis's (R, I, V, P, S(d), the :class:`AxisType` values) or a whole tensor's.

    ``isinstance(spmd.R, spmd.SpmdType)`` holds, as every per-axis type is one.
    Called as the published API builds a whole-tensor type,
    ``spmd.SpmdType(local_type, partition_spec=None)`` gives a
    :class:`~spmd_types.types.TensorSpmdType` (also an ``SpmdType``): the
    per-axis types and the layout, which ``assert_type`` and ``local_map`` take.

    Example::

        >>> import spmd_types as spmd
        >>> isinstance(spmd.R, spmd.SpmdType), spmd.SpmdType({"tp": spmd.S(0)}).local_type
        (True, {'tp': S(0)})
    """

    __slots__ = ()

    def __new__(cls, *args: object, **kwargs: object) -> SpmdType:
        if cls is SpmdType:  # the published whole-tensor form; type.__call__ then runs its __init__
            return object.__new__(WHOLE_TYPE[0])
        return object.__new__(cls)


# the whole-tensor type's class, set by _core/whole_type.py (which reads this module)
WHOLE_TYPE: list = [None]


class AxisType(SpmdType):
    """One local SPMD type on one mesh axis: R, I, V, P or S(d).

    Example::

        >>> import spmd_types as spmd
        >>> str(spmd.R), str(spmd.S(0)), spmd.backward_type(spmd.R) is spmd.P
        ('R', 'S(0)', True)
    """

    __slots__ = ("_short", "_long")

    def __init__(self, short: str, long: str) -> None:
        object.__setattr__(self, "_short", short)
        object.__setattr__(self, "_long", long)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("SPMD types are immutable")

    def __str__(self) -> str:
        return self._short

    def __repr__(self) -> str:
        return self._short

    def __reduce__(self):
        return (_by_short_name, (self._short,))

    @property
    def name(self) -> str:
        """The short name, as the published API's enum member has it (``spmd.V.name == 'V'``, ``'S(0)'``)."""
        return self._short

    @property
    def long_name(self) -> str:
        """The long name, e.g. ``'Replicate'``."""
        return self._long

    def code(self) -> str:
        """The expression that spells this type in user code, e.g. ``spmd.R``."""
        return f"spmd.{self._short}"

    @property
    def is_varying(self) -> bool:
        """True for V and every S(d): different data on each rank."""
        return False

    def backward_type(self) -> SpmdType:
        """The type of this type's gradient (``spmd.R.backward_type() is spmd.P``)."""
        return backward_type(self)


class PerMeshAxisLocalSpmdType(AxisType):
    """The four types a tensor stores per axis: R, I, V and P (``S(d)`` is V with a layout).

    Example::

        >>> import spmd_types as spmd
        >>> isinstance(spmd.R, spmd.PerMeshAxisLocalSpmdType), isinstance(spmd.S(0), spmd.PerMeshAxisLocalSpmdType)
        (True, False)
    """

    __slots__ = ()

    @property
    def value(self) -> str:
        """The one-letter name, as the published API's enum has it (``spmd.R.value == 'R'``)."""
        return self._short


class _Varying(PerMeshAxisLocalSpmdType):
    """V (varying): a different value on each rank of the axis; S(d) is V with a known layout.

    Example::

        >>> import spmd_types as spmd
        >>> spmd.V.is_varying, spmd.S(0).is_varying, spmd.backward_type(spmd.V) is spmd.V
        (True, True, True)
    """

    __slots__ = ()

    @property
    def is_varying(self) -> bool:
        return True


R = PerMeshAxisLocalSpmdType("R", "Replicate")
I = PerMeshAxisLocalSpmdType("I", "Invariant")  # noqa: E741 - the seed's name for the type
V = _Varying("V", "Varying")
P = PerMeshAxisLocalSpmdType("P", "Partial")
Replicate = R
Invariant = I
Varying = V
Partial = P
# the published API's enum members: PerMeshAxisLocalSpmdType.R is spmd.R
for _t in (R, I, V, P):
    setattr(PerMeshAxisLocalSpmdType, _t.name, _t)
del _t

class Shard(AxisType):
    """``S(d)``: V whose shards concatenate on tensor dim ``d``; ``Shard(d) is S(d)`` (one object per dim).

    Example::

        >>> S(1) is Shard(1), isinstance(S(1), Shard), S(1).dim, str(S(-1))
        (True, True, 1, 'S(-1)')
    """

    __slots__ = ("dim",)
    _interned: dict[int, Shard] = {}

    def __new__(cls, dim: int) -> Shard:
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"S(dim) needs an int tensor dim, got {dim!r}")
        found = cls._interned.get(dim)
        if found is None:
            found = object.__new__(cls)
            AxisType.__init__(found, f"S({dim})", f"Shard({dim})")
            object.__setattr__(found, "dim", dim)
            cls._interned[dim] = found
        return found

    def __init__(self, dim: int) -> None:  # built once, in __new__
        pass

    def __reduce__(self):
        return (Shard, (self.dim,))

    @property
    def is_varying(self) -> bool:
        return True


S = Shard


def base_type(t: SpmdType) -> SpmdType:
    """V for V and every S(d); the type itself otherwise (the forward/backward table's key)."""
    return V if t.is_varying else t


def _by_short_name(short: str) -> SpmdType:
    return {"R": R, "I": I, "V": V, "P": P}[short]


_BACKWARD = {R: P, P: R, I: I, V: V}


def backward_type(t: SpmdType) -> SpmdType:
    """The type of the gradient of a value of type ``t``.

    R <-> P swap (seed 000's Reduced <-> Unreduced); I, V and S(d) map to
    themselves.

    Example::

        >>> backward_type(R), backward_type(P), backward_type(S(2))
        (P, R, S(2))
    """
    if isinstance(t, Shard):
        return t
    try:
        return _BACKWARD[t]
    except (KeyError, TypeError):
        raise TypeError(f"backward_type needs an SPMD type (R, I, V, P, S(d)), got {t!r}") from None


def compatible(have: SpmdType | None, want: SpmdType, ndim: int | None = None) -> bool:
    """Does a value of type ``have`` satisfy an expected ``want``? S(d) refines V (and, locally, V may be any S(d)).

    Given the tensor's ``ndim``, ``S(-1)`` and ``S(ndim - 1)`` are the same layout.
    """
    if have is want:
        return True
    if ndim and isinstance(have, Shard) and isinstance(want, Shard):
        return have.dim % ndim == want.dim % ndim
    return have is not None and have.is_varying and want.is_varying and (have is V or want is V)


def shard_in_range(t: SpmdType, ndim: int, what: str) -> SpmdType:
    """``t`` with an S(d) counted from the front (``S(-1)`` of a 3-d tensor is ``S(2)``), or a ValueError.

    A tensor's types are kept normalized, so ``S(-1)`` and ``S(2)`` are one type
    on it; ``what`` names the argument in the error, e.g. ``'spmd.convert: dst'``.
    """
    d = getattr(t, "dim", None)
    if d is None:
        return t
    if not -ndim <= d < ndim:
        raise ValueError(f"{what}={t} names tensor dim {d}, but the tensor has {ndim} dims")
    return t if d >= 0 else S(d + ndim)


def check_type_value(value: object, what: str) -> AxisType:
    """Return ``value`` if it is one axis's SPMD type, else raise a TypeError naming ``what``."""
    if isinstance(value, AxisType):
        return value
    if value is Shard:
        raise TypeError(f"{what}: spmd.S needs a dim: spmd.S(0)")
    raise TypeError(
        f"{what} must be an SPMD type (spmd.R, spmd.I, spmd.V, spmd.P or spmd.S(d)), "
        f"got {value!r} of type {type(value).__name__}"
    )


def _is_axis_object(a: object) -> bool:
    """A mesh axis given as an object: a MeshAxis or a ProcessGroup (anything but a number, a bool or a container)."""
    return not isinstance(a, (int, float, complex, bool, list, tuple, dict, set, frozenset, bytes)) and a is not None


def _spec_entry(e: object) -> object:
    """One PartitionSpec entry, checked; a str subclass (a StrEnum axis name) becomes its plain name."""
    if isinstance(e, str):
        return str.__str__(e)
    if e is None or _is_axis_object(e) or getattr(e, "_spmd_deferred", False):  # deferred: an entry read in a trace
        return e
    if isinstance(e, tuple) and all(isinstance(a, str) or _is_axis_object(a) for a in e):
        return tuple(str.__str__(a) if isinstance(a, str) else a for a in e)
    raise TypeError(
        f"PartitionSpec entries are None, an axis name or a tuple of axis names; got {e!r}"
    )


class PartitionSpec(tuple):
    """Per tensor dim: ``None``, one mesh axis (a name, a ProcessGroup or a MeshAxis), or a tuple of axes.

    Example::

        >>> PartitionSpec(None, "tp")
        PartitionSpec(None, 'tp')
    """

    def __new__(cls, *entries: object) -> PartitionSpec:
        return super().__new__(cls, tuple(_spec_entry(e) for e in entries))

    def __repr__(self) -> str:
        return "PartitionSpec(" + ", ".join(repr(e) for e in self) + ")"

    def __eq__(self, other: object) -> bool:
        """Entry by entry, by the regions of ranks the axes stand for (a name, a group and a MeshAxis of one
        region are equal; axes of one rank shard nothing); a name is read on the current mesh."""
        if tuple.__eq__(self, other) is True:
            return True
        if not isinstance(other, tuple) or len(other) != len(self):
            return False
        equal = ENTRY_EQUAL[0]
        return all(a == b or equal(a, b) for a, b in zip(self, other))

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:  # equal specs have equal lengths (names and regions hash alike only so)
        return hash((PartitionSpec, len(self)))


# How two spec entries that differ as objects are compared: by the regions they stand for (set by
# _core/mesh.py, which can read names on the current mesh)
ENTRY_EQUAL: list = [lambda a, b: False]


class Space:
    """What a type map's axis names stand for: ``(name, region)`` pairs of the mesh it was typed on.

    Interned, so two type maps are on the same mesh exactly when their spaces
    are the same object. The regions are opaque here (``_core/axes.py``'s
    ``MeshAxis``); a type map with no space (None) matches any mesh by names.
    """

    __slots__ = ("pairs", "_regions", "__weakref__")
    _interned: dict[tuple, Space] = {}

    def __init__(self, pairs: tuple[tuple[str, object], ...]) -> None:
        self.pairs = pairs
        self._regions = dict(pairs)

    @classmethod
    def of(cls, pairs: Iterable[tuple[str, object]]) -> Space:
        key = tuple(sorted(pairs, key=lambda kv: kv[0]))
        found = cls._interned.get(key)
        if found is None:
            found = cls._interned[key] = cls(key)
        return found

    def region(self, name: str) -> object:
        return self._regions.get(name)

    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.pairs)

    def __repr__(self) -> str:
        return "Space(" + ", ".join(f"{n}={r!r}" for n, r in self.pairs) + ")"


class TypeMap:
    """An interned, immutable ``{axis: type}`` mapping: a tensor's type.

    Build one with :meth:`TypeMap.of`; equal mappings on the same :class:`Space`
    are the same object, so equality and hashing are by identity.
    """

    __slots__ = ("items", "_dict", "space", "pending", "_backward", "_replaced", "__weakref__")
    _interned: dict[tuple, TypeMap] = {}

    items: tuple[tuple[str, SpmdType], ...]

    def __init__(self, items: tuple[tuple[str, SpmdType], ...], space: Space | None = None,
                 pending: frozenset[str] = frozenset()) -> None:
        self.items = items
        self._dict = dict(items)
        self.space = space
        # global SPMD: axes where this P is a contraction's pending sum that no assert or declared type has
        # claimed yet (any other use is an error naming out_partial_axes)
        self.pending = pending
        self._backward: TypeMap | None = None  # backward(), made once (a map is immutable and interned)
        self._replaced: dict[tuple[str, SpmdType], TypeMap] = {}  # replace(axis, t), made once per pair

    @classmethod
    def of(cls, mapping: Mapping[str, SpmdType] | Iterable[tuple[str, SpmdType]], space: Space | None = None,
           pending: frozenset[str] = frozenset()) -> TypeMap:
        pairs = mapping.items() if isinstance(mapping, Mapping) else mapping
        items = tuple(sorted(pairs, key=lambda kv: kv[0]))
        key = (items, space, pending)
        found = cls._interned.get(key)
        if found is None:
            found = cls._interned[key] = cls(items, space, pending)
        return found

    def claimed(self, axes: Iterable[str] | None = None) -> TypeMap:
        """This type map with the pending sums on ``axes`` (default: all) claimed."""
        if not self.pending:
            return self
        rest = frozenset() if axes is None else self.pending - frozenset(axes)
        return TypeMap.of(self.items, self.space, rest)

    def get(self, axis: str, default: SpmdType | None = None) -> SpmdType | None:
        return self._dict.get(axis, default)

    def __getitem__(self, axis: str) -> SpmdType:
        return self._dict[axis]

    def __contains__(self, axis: object) -> bool:
        return axis in self._dict

    def axes(self) -> tuple[str, ...]:
        return tuple(a for a, _ in self.items)

    def as_dict(self) -> dict[str, SpmdType]:
        return dict(self._dict)

    def replace(self, axis: str, t: SpmdType) -> TypeMap:
        found = self._replaced.get((axis, t))
        if found is None:
            d = dict(self._dict)
            d[axis] = t
            found = self._replaced[(axis, t)] = TypeMap.of(d, self.space, self.pending - {axis})
        return found

    def backward(self) -> TypeMap:
        found = self._backward
        if found is None:
            found = self._backward = TypeMap.of(((a, backward_type(t)) for a, t in self.items), self.space)
        return found

    def code(self) -> str:
        """The dict that spells this type map in user code: ``{'dp': spmd.V, 'tp': spmd.R}``."""
        return "{" + ", ".join(f"'{a}': {t.code()}" for a, t in self.items) + "}"

    def format(self, order: Iterable[str] = ()) -> str:
        """``{dp: V, tp: R}``, axes in ``order`` first, then the rest sorted."""
        order = [a for a in order if a in self._dict]
        rest = [a for a, _ in self.items if a not in order]
        return "{" + ", ".join(f"{a}: {self._dict[a]}" for a in order + rest) + "}"

    def __repr__(self) -> str:
        return f"TypeMap({self.format()})"

    def __reduce__(self):
        return (_type_map_of, (self.items,))


def _type_map_of(items: tuple[tuple[str, SpmdType], ...]) -> TypeMap:
    """Unpickle a TypeMap (a module-level function, so ``torch.load(weights_only=True)`` can allow it)."""
    if not isinstance(items, tuple) or not all(
        isinstance(i, tuple) and len(i) == 2 and isinstance(i[0], str) and isinstance(i[1], AxisType) for i in items
    ):
        raise TypeError(f"a TypeMap is a tuple of (axis name, SPMD type) pairs, got {items!r:.80}")
    return TypeMap.of(items)
