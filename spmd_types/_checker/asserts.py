"""Turning checking on, giving tensors types, and asserting types at boundaries.

Outside :func:`typecheck` every function here returns its input untouched, so
typed code runs as plain PyTorch (erasure).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterable, Iterator, Mapping, TypeVar, Union

import torch

from .._core import state as _state
from .._core.async_tensor import settled
from .._core.dtensor_hook import interop, is_dtensor, load_if_imported
from .._core.errors import Rejection, SpmdTypeError, op_error
from .._core.implicit_mesh import mesh_of_keys, mesh_of_space
from .._core.mesh import _MESHES, Axis, current_mesh, resolve_axes, set_current_mesh
from .._core.phantom import COVERAGE, NdimWithSpmdType, assert_phantom, touch
from .._core.spec import Spec, axes_of, check_placement, check_unique, normalize, spec_from_shards, to_partition_spec
from .._core.state import STATE, checking_turned_on
from .._core.traced import register_call, routed, traced_call, zero
from .._core.types import AxisType, P, R, Shard, SpmdType, TypeMap, V, check_type_value, compatible
from .._core.whole_type import type_args
from .._guards.function_guard import WATCHED, check_apply_outputs, forget_last_caller
from .._guards.optim_checks import name_parameters
from .._local.transitions import route_call
from . import latent
from .foreach import single_form  # noqa: F401  (importing it registers the multi-tensor kernels' rules)
from .latent import C10D_WORLD, RECORDS, apply_remembered, remember, remembered
from .latent import PLAIN as _PLAIN
from .reading import (  # noqa: F401 - the readers are re-exported here, beside assert_type
    by_region,
    get_axis_local_type,
    get_type,
    maybe_get_axis_local_type,
    present,
    rehome_here,
)
from .run_ops import _TYPED_CLASSES
from .tensor import _DisableTF, make_typed, type_in_place
from .trace import log_op

__all__ = ["typecheck", "assert_type", "get_type", "is_checking", "get_axis_local_type", "maybe_get_axis_local_type"]

T = TypeVar("T")
_weak = weakref.ref
_dynamo_tracing = torch.compiler.is_dynamo_compiling
_COMPILER = torch.compiler
_type = type  # (assert_type's published keyword type= shadows the builtin there)
_NONE = object()  # no value given
TypeSpec = Mapping[Axis, SpmdType]


LocalSpec = Union[bool, Iterable[str], Mapping[str, bool]]


def _local_axes(local: LocalSpec) -> tuple[bool, frozenset]:
    """(global mode on?, the axes that stay local) from typecheck's ``local=`` argument, checked."""
    if local is True:
        return False, frozenset()
    if local is False:
        return True, frozenset()
    if isinstance(local, Mapping):
        for a, is_local in local.items():
            if not isinstance(is_local, bool):
                raise TypeError(f"typecheck(local={{...}}) maps axis names to True or False, got {a!r}: {is_local!r}")
        names, axes = list(local), frozenset(a for a, is_local in local.items() if is_local)
    elif isinstance(local, str):
        names, axes = [local], frozenset([local])
    elif isinstance(local, Iterable) and not isinstance(local, (bytes, torch.Tensor)):
        names = list(local)
        axes = None
    else:
        raise TypeError(
            "typecheck(local=...) takes True, False, an axis name, a collection of axis names or {axis: bool}; "
            f"got {local!r}"
        )
    mesh = current_mesh()
    for a in names:
        if not isinstance(a, str):
            raise TypeError(f"typecheck(local=...): axis names are str, got {a!r}")
        if mesh is not None and a not in mesh.groups:
            known = ", ".join(repr(n) for n in mesh.axis_names)
            raise ValueError(f"typecheck(local=...): unknown mesh axis {a!r}; the current mesh has axes {known}")
    return True, frozenset(names) if axes is None else axes


@contextlib.contextmanager
def typecheck(strict_mode: str | None = None, local: LocalSpec | None = None, *,
              strict: bool | None = None) -> Iterator[None]:
    """Check every op on typed tensors inside the block.

    ``local=True`` (the default) checks local SPMD on every axis; ``local=False``
    checks global SPMD (partition specs, shard propagation) on every axis; a
    collection of axis names (or ``{axis: is_local}``) keeps those axes local
    and checks the others globally. ``strict=True`` (the published API's
    ``strict_mode="strict"``) also rejects a plain (untyped) tensor meeting a
    typed one; ``strict_mode="permissive"`` is ``strict=False``. Nested inside
    another ``typecheck()``, what is not given is inherited from it; the
    outermost defaults are local and permissive (docs/choices.md, choice 41).
    Checking is per thread.

    Example::

        with spmd.set_current_mesh(mesh), spmd.typecheck():
            y = spmd.assert_type(x, {"tp": spmd.R}) * 2
        with spmd.set_current_mesh(mesh), spmd.typecheck(local=["ep"]):
            ...  # global SPMD on every axis but "ep"
    """
    strict = _strictness(strict_mode, strict)
    saved = (STATE.checking, STATE.strict, STATE.global_mode, STATE.local_axes)
    if local is None:  # inherited inside another typecheck(), else local SPMD
        global_mode, local_axes = (STATE.global_mode, STATE.local_axes) if STATE.checking else (False, frozenset())
    else:
        global_mode, local_axes = _local_axes(local)  # a bad argument raises before any state changes
    if strict is None:
        strict = STATE.strict if STATE.checking else False
    if not STATE.checking:  # the outermost typecheck(): what must happen before the first checked op
        for prepare in ON_FIRST_TYPECHECK:
            prepare()
    checking_turned_on()
    STATE.checking, STATE.strict = True, strict
    STATE.global_mode, STATE.local_axes = global_mode, local_axes
    load_if_imported()  # DTensor's registrations (DTensor.from_local of a typed tensor) before the first op
    try:
        apply_remembered(assert_type)  # types given by assert_type outside typecheck()
        yield
        if WATCHED.outputs:  # a Function that returned its input as it is, its output never used since
            check_apply_outputs()
    finally:
        WATCHED.outputs = []
        forget_last_caller()
        STATE.checking, STATE.strict, STATE.global_mode, STATE.local_axes = saved


# called as the outermost typecheck() begins (the hooked Functions' registration, _boundaries/hook_registration.py)
ON_FIRST_TYPECHECK: list[Callable[[], None]] = []


def _strictness(strict_mode: str | None, strict: bool | None) -> bool | None:
    """``strict=`` or the published ``strict_mode=`` (not both), checked; None when neither is given."""
    if strict_mode is not None:
        if strict is not None:
            raise TypeError("typecheck() takes strict_mode= or strict=, not both")
        if not isinstance(strict_mode, str):  # typecheck(True) meant strict=True or local=True
            raise TypeError(f"typecheck(strict_mode=...) takes 'strict' or 'permissive', got {strict_mode!r}; "
                            "local or global SPMD is local=..., strictness strict=...")
        if strict_mode not in ("strict", "permissive"):
            raise ValueError(f"typecheck(strict_mode=...) takes 'strict' or 'permissive', got {strict_mode!r}")
        return strict_mode == "strict"
    if strict is not None and not isinstance(strict, bool):
        raise TypeError(f"typecheck(strict=...) takes True or False, got {strict!r}")
    return strict


def is_checking() -> bool:
    """True inside :func:`typecheck` on this thread."""
    return STATE.checking


def _resolve_types(types: TypeSpec, what: str) -> dict[str, SpmdType]:
    """``{name: type}`` over the current mesh's typed axes from a user's type dict.

    Keys are names (str or StrEnum), ProcessGroups, MeshAxis objects or 1-D
    DeviceMeshes; a key over several axes (a flattened group) types each of
    them; a key of size 1 types nothing. When two keys name one axis, the later
    may agree, refine V to S(d), or change a type read back with ``get_local_type``
    (its keys are MeshAxis objects: torchtitan's loss does ``out = dict(spmd.get_local_type(x));
    out[tp_group] = spmd.I``); two types the caller spelled for one axis are an SpmdTypeError naming it.
    """
    if not isinstance(types, Mapping):
        raise TypeError(f"{what} takes types as a dict {{axis: type}}, e.g. {{'tp': spmd.R}}; got {types!r}")
    if current_mesh() is None:
        raise RuntimeError(f"{what} needs a current mesh: wrap the code in `with spmd.set_current_mesh(mesh):`")
    out: dict[str, SpmdType] = {}
    keys: dict[str, Any] = {}
    for a, t in types.items():
        t = check_type_value(t, f"the type for axis {a!r}")
        for name in resolve_axes(a):
            have = out.get(name)
            if have is not None and have is not t and not (have is V and t.is_varying):
                if t is V and have.is_varying:  # V after S(d): S(d) already says more
                    continue
                if _read_back(keys[name]) and not _read_back(a):  # a type read with get_local_type, changed
                    out[name], keys[name] = t, a
                    continue
                raise SpmdTypeError(f"{what}: axis '{name}' is given two types, {have} (key {_key_text(keys[name])}) "
                                    f"and {t} (key {_key_text(a)}); an axis has one type")
            out[name], keys[name] = t, a
    return out


def _read_back(key: Any) -> bool:
    """A key as ``get_local_type`` spells it (a MeshAxis), not as a caller names an axis (a name or a group)."""
    from .._core.axes import MeshAxis

    return isinstance(key, MeshAxis)


def _key_text(key: Any) -> str:
    return repr(str.__str__(key)) if isinstance(key, str) else type(key).__name__


def _typed_spec(spec: Spec) -> Spec:
    """A normalized spec with every axis resolved to the current mesh's typed names (size-1 axes dropped)."""
    return tuple(tuple(n for a in entry for n in resolve_axes(a)) for entry in spec)


def _placed(t: torch.Tensor, types: TypeSpec, partition_spec: Any) -> tuple[TypeMap, Spec | None]:
    """Types and partition spec from a type dict (S(d) entries) and an optional partition spec.

    Axes the dict leaves out are V if the spec places them; otherwise V on axes
    checked locally and R on axes checked globally (an unmentioned axis is
    replicated, as in JAX).
    """
    return _placed_and_given(t, types, partition_spec)[:2]


def _placed_and_given(t: torch.Tensor, types: TypeSpec, partition_spec: Any) -> tuple[TypeMap, Spec | None, dict]:
    """:func:`_placed`, and the resolved type dict it started from (``_resolve_types``), read from ``t``'s ndim,
    the assertion, the current mesh and the checking mode only: remembered per those (not to be mutated)."""
    with _DisableTF():
        ndim = t.dim()
    mesh = current_mesh()
    key = None
    if type(types) is dict and mesh is not None:
        try:
            key = (tuple(types.items()), partition_spec, ndim, mesh.token, STATE.global_mode, STATE.local_axes)
            found = _PLACED.get(key)
        except TypeError:  # an unhashable axis or spec: worked out every time
            key = found = None
        if found is not None:
            return found
    found = _placed_uncached(types, partition_spec, ndim)
    if key is not None:
        if len(_PLACED) >= 2048:
            _PLACED.clear()
        _PLACED[key] = found
    return found


_PLACED: dict[tuple, tuple[TypeMap, Spec | None, dict]] = {}


def _placed_uncached(types: TypeSpec, partition_spec: Any, ndim: int) -> tuple[TypeMap, Spec | None, dict]:
    resolved = given = _resolve_types(types, "assert_type")
    mesh = current_mesh()
    spec = spec_from_shards(given, ndim, mesh.typed_axes)  # checks every S(d) is in range
    given = {a: (Shard(ty.dim % ndim) if isinstance(ty, Shard) else ty) for a, ty in given.items()}  # S(-1): S(ndim-1)
    if partition_spec is not None:
        user = normalize(partition_spec, ndim)
        user = _typed_spec(user)
        check_unique(user, partition_spec)
        for d, (a, b) in enumerate(zip(spec, user)):
            if a and b and a != b:
                raise ValueError(f"dim {d}: the types say S({d}) on {a}, the partition spec says {b}")
        for d, entry in enumerate(user):
            for axis in entry:
                dim = getattr(given.get(axis), "dim", None)
                if dim is not None and dim % ndim != d:
                    raise ValueError(
                        f"axis '{axis}': the types say S({dim}), but the partition spec places it on dim {d}"
                    )
        spec = tuple(b or a for a, b in zip(spec, user))
    placed = axes_of(spec)
    global_axes = mesh.global_axes(STATE.local_axes) if STATE.global_mode else frozenset()
    full: dict[str, SpmdType] = {}
    for axis in mesh.typed_axes:
        t_axis = given.get(axis)
        if t_axis is None:
            t_axis = V if (axis in placed or axis not in global_axes) else R
        elif axis in placed and not t_axis.is_varying:
            raise ValueError(f"axis '{axis}' shards a dim in the partition spec but its type is {t_axis}, not V")
        full[axis] = t_axis
    return TypeMap.of(full, mesh.space), (spec if (placed or global_axes) else None), resolved


def assert_type(tensor: T, types: TypeSpec = None, *more: Any, partition_spec: Any = None, type: Any = _NONE) -> T:
    """Give ``tensor`` its SPMD types, or check the types it has.

    Inside :func:`typecheck`: a plain tensor is typed in place (the same
    object is an LTensor with ``types`` afterwards, and is returned; axes of the
    current mesh that ``types`` leaves out are V in local SPMD, R in global); a
    typed tensor is checked (``S(d)`` refines V) and returned; an ``nn.Module``
    has every parameter and buffer typed. A list or tuple of tensors has each
    typed. Outside :func:`typecheck` ``t`` stays a plain tensor (no cost to
    later ops) and remembers the type, which :func:`typecheck` gives it when it
    starts (the published API types parameters at parallelize time).

    The type may come in parts, as the published API takes them: type dicts, an
    ``spmd.SpmdType``, a ``PartitionSpec`` and one bare R, I, V or P that fills
    the axes nothing else names (``assert_type(x, spmd.R, {"cp": spmd.V})``);
    see :func:`spmd.merge_types`. ``type=`` is the published 0.2.3 keyword
    for ``types`` (``assert_type(tensor=x, type={...})``); give one or the other.

    Example::

        with spmd.set_current_mesh(mesh), spmd.typecheck():
            w = torch.randn(16, 16)
            spmd.assert_type(w, {"dp": spmd.I, "tp": spmd.I})  # w itself is typed now
            spmd.assert_type(w, {"tp": spmd.I})  # passes
    """
    t, published = tensor, type  # (the published 0.2.3 keyword, assert_type(tensor=x, type={...}), shadows type())
    if _type(types) is dict and (_state.never_checked or not STATE.checking) and _type(t) in _PLAIN and not (
            more or published is not _NONE or _dynamo_tracing() or _COMPILER._is_compiling_flag):  # compiling()
        # erased, the common case: recorded for a later typecheck(), t stays plain (latent.remember, inline: an
        # erased call is one Python frame)
        key = id(t)
        entry = RECORDS.get(key)
        if entry is None or entry[0]() is not t:  # none yet, or a dead tensor's under a reused id
            RECORDS[key] = (_weak(t), types, partition_spec, _MESHES.top, C10D_WORLD._default_pg)
            if entry is None and len(RECORDS) >= latent.prune_at:  # (a replaced entry leaves the size as it was)
                latent.prune()
            return t
        if entry[3] is _MESHES.top and entry[4] is C10D_WORLD._default_pg and (
                entry[1] is types and entry[2] is partition_spec  # asserted again as recorded (a parameter every step)
                or _adds_nothing(entry[1], entry[2], types, partition_spec)):  # (one of several dicts, in turn)
            return t  # the record already says it
        types, partition_spec = _joined_record(entry[1:], types, partition_spec)  # the new axes join the record
        return remember(t, types, partition_spec)
    return _assert_type(t, types, more, partition_spec, published)


def _assert_type(t: Any, types: Any, more: tuple, partition_spec: Any, published: Any) -> Any:
    """:func:`assert_type` past its erased common case (kept apart: a function with closures pays for its cells on
    every call, and the erased call is the one a process that never checks makes)."""
    if published is not _NONE:  # the published 0.2.3 keyword, assert_type(tensor=x, type={...})
        if types is not None:
            raise TypeError("assert_type: the type is given twice, by position and as type=")
        types = published
    if more or (type(types) is not dict and (partition_spec is not None or not isinstance(types, AxisType))):
        if routed():  # torch.compile traces: the parts (references to types read in the trace) join when checked
            if STATE.checking:
                traced_call("assert_type", t, types, *more, partition_spec=partition_spec)
            return t
        types, partition_spec = _joined(types, more, partition_spec)  # in parts, a whole SpmdType (merge_types)
    if not STATE.checking:  # erased, the other cases: recorded for a later typecheck() (latent.py)
        if routed():
            return t  # the erased program traced by torch.compile: nothing to remember in a graph
        if type(types) is dict and remembered(t) is not None:  # asserted again: the new axes join the record
            types, partition_spec = _joined_record(remembered(t), types, partition_spec)
        return remember(t, types, partition_spec)
    if routed():  # torch.compile traces: one graph node, which the compiled graph's checker reads
        traced_call("assert_type", t, types, partition_spec=partition_spec)
        return t
    if current_mesh() is None:  # typed by groups alone: the axes named (or t's own) are the mesh
        own = _own_mesh(t, types, partition_spec)
        if own is not None:
            with set_current_mesh(own):
                return assert_type(t, types, partition_spec=partition_spec)
    if COVERAGE.stack:  # a Function's spmd_typecheck hook is running: t is accounted for
        touch(t)
        if isinstance(t, NdimWithSpmdType):
            return assert_phantom(t, types, partition_spec)  # type: ignore[return-value]
    if type(t) in _TYPED_CLASSES and type(types) is dict:  # the common re-assertion (a parameter every step)
        old = t._spmd_types
        out = _refine(t, types, partition_spec)
        if STATE.tracing:
            log_op("assert_type", [old], out)
        return out
    if isinstance(t, (list, tuple)):
        return type(t)(assert_type(x, types, partition_spec=partition_spec) for x in t)  # type: ignore[return-value]
    if isinstance(types, AxisType):  # one type for every axis of the current mesh
        mesh = current_mesh()
        if mesh is None:
            raise RuntimeError(f"assert_type(x, spmd.{types}) types every axis of the current mesh, and none is current")
        types = {a: types for a in mesh.typed_axes}
    if isinstance(t, torch.nn.Module):
        if partition_spec is not None:
            raise TypeError("assert_type on a module types every parameter alike: pass no partition_spec")
        for member in list(t.parameters()) + list(t.buffers()):
            if getattr(member, "_spmd_types", None) is not None:
                _refine(member, types, None)
            else:
                _type_or_check(member, *_placed(member, types, None))
        name_parameters(t)  # error messages about a gradient can then name its parameter
        return t
    if is_dtensor(t):
        return interop().assert_dtensor(t, types, partition_spec)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"assert_type takes a tensor (or a list or tuple of tensors) or an nn.Module, got {type(t).__name__}")
    old = getattr(t, "_spmd_types", None)
    if old is not None:
        out = _refine(t, types, partition_spec)
    else:
        out = _type_or_check(t, *_placed(t, types, partition_spec))
    if STATE.tracing:
        log_op("assert_type", [old], out)
    return out  # type: ignore[return-value]


def _joined_record(record: tuple, types: dict, partition_spec: Any) -> tuple[Any, Any]:
    """A second assert outside typecheck(): the axes it names join the first's (as on a typed tensor, where an
    assert checks the axes it names and leaves the others)."""
    old_types, old_spec = record[0], record[1]
    if type(old_types) is not dict:
        return types, partition_spec
    if _adds_nothing(old_types, old_spec, types, partition_spec):
        return old_types, old_spec  # nothing new: the record's own objects
    return {**old_types, **types}, partition_spec if partition_spec is not None else old_spec


def _adds_nothing(old_types: Any, old_spec: Any, types: dict, partition_spec: Any) -> bool:
    """Whether a record of ``old_types`` and ``old_spec`` already says what an assert of ``types`` and
    ``partition_spec`` says: each axis named with the same type object, and no other spec."""
    if type(old_types) is not dict or not (partition_spec is None or partition_spec is old_spec):
        return False
    recorded = old_types.get
    for axis, axis_type in types.items():
        if recorded(axis, _NONE) is not axis_type:
            return False
    return True


def _own_mesh(t: Any, types: Any, partition_spec: Any) -> Any:
    space = getattr(getattr(t, "_spmd_types", None), "space", None)
    return mesh_of_space(space) if space is not None else mesh_of_keys(types, partition_spec)


def _joined(types: Any, more: tuple, partition_spec: Any) -> tuple[Any, Any]:
    """The type given in parts, joined (merge_types); with checking off a part it cannot read is kept as given, to
    be read when typecheck() applies it (an erased assert looks at nothing)."""
    if STATE.checking:
        return type_args(types, more, partition_spec)
    try:
        return type_args(types, more, partition_spec)
    except (TypeError, ValueError):
        return types, partition_spec


def _refine(t: torch.Tensor, types: TypeSpec, partition_spec: Any) -> torch.Tensor:
    """Check typed ``t`` on the axes the assertion names (types or partition spec); leave the others alone.

    Asserting ``S(d)`` on a V axis refines it: the tensor's type becomes
    ``S(d)`` (same object; in global SPMD the partition spec gains the axis).
    A tensor typed on another presentation of the ranks is first presented on
    the current mesh (compared by regions of ranks, never by names).
    """
    key = _passing_key(t, types, partition_spec)
    if key is not None and key in _PASSED:
        return t  # this very assertion passed on this very type and layout before, and changed nothing
    full, spec, given = _placed_and_given(t, types, partition_spec)
    named = set(given) | (axes_of(spec) if spec is not None else set())
    have = rehome_here(t, "assert_type")
    shown = have
    for axis in named:
        shown = shown.replace(axis, full[axis])
    with _DisableTF():
        ndim = t.dim()
    _check(have, shown, named, ndim)
    refined = have
    for axis in named:
        w = full[axis]
        if w.is_varying and w is not V and have.get(axis) is V:
            refined = refined.replace(axis, w)
    if have.pending:  # asserting P claims a contraction's pending sum (global SPMD)
        refined = refined.claimed(a for a in named if full[a] is P)
    changed = refined is not have
    if changed:
        t._spmd_types = refined  # type: ignore[attr-defined]
        if spec is not None:  # kept in local SPMD too: a global region after it reads the layout
            _add_placements(t, spec, {a for a in named if refined.get(a) is not have.get(a)})
    elif partition_spec is not None and spec is not None and not STATE.global_mode:
        # a V axis the given partition spec places, asserted in local SPMD (torchtitan's view in spmd.local()
        # re-declares its layout so): the layout a global region after it reads, as the published package keeps it
        _add_placements(t, spec, {a for a in named if refined.get(a) is V})
    if STATE.global_mode and spec is not None:
        # a plain V says nothing of the layout (S(d) refines V): only S(d) and a given partition spec place an axis
        placing = named if partition_spec is not None else {a for a in named if given.get(a) is not V}
        _check_spec(t, spec, placing)
    if not changed and key is not None and have is key[0] and getattr(t, "_spmd_spec", None) == key[1]:
        if len(_PASSED) >= _PASSED_LIMIT:
            _PASSED.clear()
        _PASSED.add(key)
    return t


# Re-assertions that passed and changed nothing (a model's parameters asserted every step, torchtitan's module
# boundaries): (the tensor's interned type, its partition spec, the assertion, ndim, the current mesh, the
# checking mode). The checks read nothing else.
_PASSED: set[tuple] = set()
_PASSED_LIMIT = 2048


def _passing_key(t: torch.Tensor, types: TypeSpec, partition_spec: Any) -> tuple | None:
    """The key of a re-assertion on typed ``t``, or None (a pending sum, types not a dict, unhashable parts)."""
    if type(types) is not dict:
        return None
    have = t._spmd_types  # type: ignore[attr-defined]
    if have.pending:
        return None
    with _DisableTF():
        ndim = t.dim()
    try:
        mesh = current_mesh()
        key = (have, getattr(t, "_spmd_spec", None), tuple(types.items()), partition_spec, ndim,
               None if mesh is None else mesh.token, STATE.global_mode, STATE.local_axes)
        hash(key)
    except TypeError:  # an axis or a spec given by an unhashable object: checked in full
        return None
    return key


def _add_placements(t: torch.Tensor, spec: Spec, axes: set) -> None:
    """Give ``t``'s partition spec the newly refined ``axes`` where ``spec`` places them."""
    have = getattr(t, "_spmd_spec", None) or tuple(() for _ in range(t.dim()))
    placed = axes_of(have)
    t._spmd_spec = tuple(  # type: ignore[attr-defined]
        tuple(h) + tuple(a for a in e if a in axes and a not in placed) for h, e in zip(have, spec)
    )


def _type_or_check(t: torch.Tensor, want: TypeMap, spec: Spec | None) -> torch.Tensor:
    have = getattr(t, "_spmd_types", None)
    if have is None:
        if STATE.global_mode:
            _check_layout(want, spec if spec is not None else tuple(() for _ in range(t.dim())))
        waited = settled(t)
        if waited is not t:  # an AsyncCollectiveTensor (a wrapper) cannot become an LTensor: its waited value does
            out = make_typed(waited, want)
        else:
            out = type_in_place(t, want)  # the object given carries the type (torchtitan never reads the result)
        if spec is not None:
            out._spmd_spec = spec
        return out
    _check(rehome_here(t, "assert_type"), want, None, t.dim())
    if STATE.global_mode and spec is not None:
        _check_spec(t, spec)
    return t


def _check_layout(types: TypeMap, spec: Spec) -> None:
    mesh = current_mesh()
    why = check_placement(types, spec, mesh.global_axes(STATE.local_axes))
    if why:
        raise op_error(
            Rejection(f"Global SPMD: {why}.", [("types", types.format()), ("partition spec", str(spec))],
                      ["spmd.assert_type(x, {...}, partition_spec=spmd.PartitionSpec(...))"]),
            "assert_type", ("x", "types"))


def _check_spec(t: torch.Tensor, want: Spec, named: set | None = None) -> None:
    mesh = current_mesh()
    global_axes = mesh.global_axes(STATE.local_axes)
    if named is not None:  # a refining assert looks at the axes it names only
        global_axes = global_axes & named
    have = getattr(t, "_spmd_spec", None) or tuple(() for _ in range(t.dim()))
    have_g = tuple(tuple(a for a in e if a in global_axes) for e in have)
    want_g = tuple(tuple(a for a in e if a in global_axes) for e in want)
    if have_g != want_g:
        raise op_error(
            Rejection(
                "Type assertion failed: the tensor's partition spec differs from the asserted one.",
                [("have", repr(to_partition_spec(have_g))), ("want", repr(to_partition_spec(want_g)))],
                [f"spmd.redistribute(x, {to_partition_spec(have_g)!r}, {to_partition_spec(want_g)!r})"],
            ),
            "assert_type",
            ("x", "types"),
        )


def _check(have: TypeMap, want: TypeMap, named: set | None = None, ndim: int | None = None) -> None:
    for axis, w in want.items:
        if named is not None and axis not in named:
            continue
        h = have.get(axis)
        if compatible(h, w, ndim):
            continue
        fix = route_call("x", axis, h, w) if h is not None else None
        raise op_error(
            Rejection(
                f"Type assertion failed: the tensor is {h} on axis '{axis}', and the assertion says {w}.",
                [("have", have.format()), ("want", want.format()), ("axis", f"'{axis}': {h} is not {w}")],
                [fix] if fix else [],
            ),
            "assert_type",
            ("x", "types"),
        )


register_call("assert_type", assert_type, zero)
