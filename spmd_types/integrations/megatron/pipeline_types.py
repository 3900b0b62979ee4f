"""The types that cross between Megatron pipeline stages, declared once for the whole pipeline.

``StageTypes`` (one stage's side) and ``PipelineTypes`` (the whole pipeline's
declaration, checked when made: what stage k sends is exactly what stage k+1
receives). ``pipeline.py`` holds the communicator that checks sends against
it; this module never imports ``megatron.core``.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Sequence

from ..._core import errors as _errors
from ..._core.errors import Rejection, SpmdTypeError
from ..._core.types import I, R, S, SpmdType, check_type_value
from ..._local.transitions import route_call

__all__ = ["StageTypes", "PipelineTypes", "Types", "conversion", "shown"]

Types = Mapping[str, SpmdType]

# ---------------------------------------------------------------------------
# the declaration


class StageTypes(NamedTuple):
    """What one pipeline stage receives from the previous stage and sends to the next, as ``{axis: type}``.

    ``receives`` is None on the first stage and ``sends`` None on the last. The
    pipeline axis is left out: an activation is V there.

    Example::

        first = spmd_megatron.StageTypes(sends={"dp": spmd.V, "tp": spmd.S(0)})
        last = spmd_megatron.StageTypes(receives={"dp": spmd.V, "tp": spmd.S(0)})
    """

    receives: Types | None = None
    sends: Types | None = None


def _declared(types: Any, what: str) -> dict[str, SpmdType]:
    if not isinstance(types, Mapping) or not all(isinstance(a, str) for a in types):
        raise TypeError(f"spmd_megatron.PipelineTypes: {what} is a dict {{axis name: type}}, e.g. "
                        f"{{'dp': spmd.V, 'tp': spmd.I}}; got {types!r}")
    return {a: check_type_value(t, f"spmd_megatron.PipelineTypes: {what}[{a!r}]") for a, t in types.items()}


def _code(types: Mapping[str, SpmdType]) -> str:
    return "{" + ", ".join(f"'{a}': {t.code()}" for a, t in types.items()) + "}"


def shown(types: Mapping[str, SpmdType]) -> str:
    return "{" + ", ".join(f"{a}: {t}" for a, t in types.items()) + "}"


class PipelineTypes:
    """The types that cross between pipeline stages, declared once for the whole pipeline.

    ``PipelineTypes(activation)``: every stage sends the next one an activation
    of this type (Megatron's hidden states: ``{"dp": V, "tp": I}``, or
    ``{"dp": V, "tp": S(0)}`` under sequence parallel). ``PipelineTypes(stages=[...])``:
    one :class:`StageTypes` per stage, when stages differ; what stage k sends
    must be exactly what stage k+1 receives, checked here. A gradient crosses
    back with the dual type (``spmd.backward_type``). Give every stage the same
    declaration (on real processes, :func:`p2p_communicator` checks that they do).

    Example::

        types = spmd_megatron.PipelineTypes({"dp": spmd.V, "tp": spmd.S(0)})
        types = spmd_megatron.PipelineTypes(stages=[
            spmd_megatron.StageTypes(sends={"dp": spmd.V, "tp": spmd.I}),
            spmd_megatron.StageTypes(receives={"dp": spmd.V, "tp": spmd.I}),
        ])
    """

    def __init__(self, activation: Types | None = None, *, stages: Sequence[StageTypes] | None = None) -> None:
        if (activation is None) == (stages is None):
            raise TypeError("spmd_megatron.PipelineTypes takes one type for every stage boundary "
                            "(PipelineTypes({'dp': spmd.V, 'tp': spmd.I})) or one StageTypes per stage (stages=[...])")
        self.activation = None if activation is None else _declared(activation, "activation")
        self.stages: tuple[StageTypes, ...] | None = None
        if stages is not None:
            self.stages = tuple(_checked_stages(stages))

    def boundary(self, stage: int, n_stages: int) -> dict[str, SpmdType]:
        """The type crossing from ``stage`` to ``stage + 1`` in a pipeline of ``n_stages``."""
        if self.stages is None:
            return dict(self.activation)  # type: ignore[arg-type]
        return dict(self.stages[stage].sends)  # type: ignore[arg-type]

    def key(self, n_stages: int) -> tuple:
        """Every boundary's type, as text: equal on every stage of one pipeline."""
        return tuple(shown(self.boundary(k, n_stages)) for k in range(n_stages - 1))

    def __repr__(self) -> str:
        if self.stages is None:
            return f"PipelineTypes({shown(self.activation)})"  # type: ignore[arg-type]
        return "PipelineTypes(stages=" + repr(list(self.stages)) + ")"


def _checked_stages(stages: Sequence[StageTypes]) -> list[StageTypes]:
    if not isinstance(stages, (list, tuple)) or len(stages) < 2 or not all(isinstance(s, StageTypes) for s in stages):
        raise TypeError("spmd_megatron.PipelineTypes: stages= is a list of one spmd_megatron.StageTypes per pipeline "
                        f"stage (two or more); got {stages!r}")
    out = []
    last = len(stages) - 1
    for k, s in enumerate(stages):
        if (s.receives is None) != (k == 0) or (s.sends is None) != (k == last):
            does, call = ({0: ("receives nothing and sends its activation", "StageTypes(sends=...)"),
                           last: ("receives its activation and sends nothing", "StageTypes(receives=...)")}
                          .get(k, ("receives and sends its activation", "StageTypes(receives=..., sends=...)")))
            where = "the first" if k == 0 else "the last" if k == last else "a middle"
            raise ValueError(f"spmd_megatron.PipelineTypes: stage {k} is {where} stage: it {does}, "
                             f"{call}; got {s}")
        out.append(StageTypes(None if k == 0 else _declared(s.receives, f"stage {k} receives"),
                              None if k == last else _declared(s.sends, f"stage {k} sends")))
    for k in range(last):
        sent, got = out[k].sends, out[k + 1].receives
        if sent != got:
            raise _declared_mismatch(k, sent, got)  # type: ignore[arg-type]
    return out


def _declared_mismatch(k: int, sent: dict[str, SpmdType], got: dict[str, SpmdType]) -> SpmdTypeError:
    axis = next(a for a in [*sent, *got] if sent.get(a) is not got.get(a))
    h, w = sent.get(axis), got.get(axis)
    fixes = []
    if h is not None and w is not None:
        fixes.append(f"stage {k} converts before it sends: {conversion('output', axis, h, w)}")
    fixes.append(f"spmd_megatron.StageTypes(receives={_code(sent)}, ...) for stage {k + 1}, if its code takes that")
    return SpmdTypeError(
        Rejection(
            f"What a pipeline stage sends is what the next stage receives: stage {k} declares it sends "
            f"{_or_none(h)} on {axis!r}, and stage {k + 1} declares it receives {_or_none(w)} there.",
            [(f"stage {k} sends", shown(sent)), (f"stage {k + 1} receives", shown(got)),
             ("axis", f"'{axis}': {_or_none(h)} is not {_or_none(w)}")],
            fixes,
        ),
        _errors.user_source_line(),
    )


def _or_none(t: SpmdType | None) -> str:
    return "no type" if t is None else str(t)


def conversion(x: str, axis: str, have: SpmdType, want: SpmdType) -> str:
    call = route_call(x, axis, have, want) or f"spmd.redistribute({x}, '{axis}', src={have.code()}, dst={want.code()})"
    if isinstance(have, S) and have.dim == 0 and want in (I, R):
        call += (f"  # Megatron: gather_from_sequence_parallel_region({x}, "
                 f"tensor_parallel_output_grad={want is R})")
    return call
