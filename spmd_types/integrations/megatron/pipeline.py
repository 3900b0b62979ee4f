"""Typed pipeline stages for Megatron-core: the types that cross between stages, declared once, checked at each send.

Megatron moves a stage's activations to the next stage, and their gradients
back, with point-to-point sends (``P2PCommunicator`` in
``megatron.core.pipeline_parallel.p2p_communication``). A send carries no type,
and every process runs one stage's program, so the contract between stages is
declared once for the whole pipeline (:class:`PipelineTypes`, in pipeline_types.py), the same on
every stage, and :func:`p2p_communicator` makes Megatron's communicator for
this stage with it:

* what a stage sends forward must have the type the next stage receives, and
  what it sends back the gradient type of what it received; a mismatch is an
  ``SpmdTypeError`` naming both stages, before Megatron sends anything;
* a received activation is given the declared type and a received gradient its
  dual (``backward_type``); both are V on the pipeline axis (each stage holds
  its own);
* a received activation whose gradient is not sent back is an error: at a send
  of ``None``, and at the end of :meth:`TypedP2PCommunicator.iteration` for one
  never sent.

On a fake process group one stage's program runs and the declaration stands for
its neighbours; on real processes each stage checks its own sends against the
same declaration, and making the communicator checks once that every stage holds
an equal one. ``parameter_type_on_pp`` is the pipeline axis's parameter type
(used by ``type_parameters``). ``megatron.core`` is imported only when called.
"""

from __future__ import annotations

import contextlib
import os
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from ..._checker.tensor import format_tensor_type, type_in_place
from ..._comm.call import unwrap
from ..._core import errors as _errors
from ..._core.errors import Rejection, SpmdTypeError
from ..._core.mesh import current_mesh, resolve_axes
from ..._core.state import STATE
from ..._core.types import I, R, S, SpmdType, TypeMap, V, compatible
from .pipeline_types import PipelineTypes, StageTypes, conversion

__all__ = ["StageTypes", "PipelineTypes", "p2p_communicator", "parameter_type_on_pp"]

# ---------------------------------------------------------------------------
# parameters on the pipeline axis


def parameter_type_on_pp(param: torch.nn.Parameter) -> SpmdType:
    """A Megatron parameter's type on the pipeline axis: V, or R for the tied word embedding at pp=2.

    Each stage holds its own layers, and their gradients are never summed over
    the stages: V. The word embedding tied to the output layer
    (``share_embeddings_and_output_weights``) is held twice, by the first stage
    and by the last, marked ``shared_embedding``, kept equal, and its gradient
    all-reduced over Megatron's embedding group by ``finalize_model_grads``: R,
    whose gradient is P until that sum, when the embedding group is the whole
    pipeline axis (pp=2). With more stages the group is two of them, which no
    type on the axis can say: ``NotImplementedError``.

    Example::

        spmd_megatron.parameter_type_on_pp(model.decoder.layers[0].mlp.linear_fc1.weight)  # V
    """
    if not getattr(param, "shared_embedding", False):
        return V
    from megatron.core import parallel_state as ps

    mesh = current_mesh()
    pp = sorted(dist.get_process_group_ranks(mesh.groups["pp"])) if mesh is not None and "pp" in mesh.groups else []
    group = ps.get_embedding_group(check_initialized=False)
    embd = sorted(dist.get_process_group_ranks(group)) if group is not None else []
    if embd and embd == pp:
        return R
    raise NotImplementedError(
        f"spmd_megatron.type_parameters: the tied word embedding (a parameter marked shared_embedding, "
        f"{list(param.shape)}) is summed over Megatron's embedding group (ranks {embd}), the first and last "
        f"pipeline stages, which is not the whole pipeline axis (ranks {pp}): no type on 'pp' says 'the same on two "
        "of its ranks'. Untie it (share_embeddings_and_output_weights=False) or use pipeline_model_parallel_size=2"
    )


# ---------------------------------------------------------------------------
# the communicator


@dataclass
class _Received:
    """An activation this stage received, waiting for its gradient to be sent back."""

    micro_batch: int
    shown: str
    where: str | None


def _report_callers_of_megatron_pipeline() -> None:
    """Errors name the user's call into Megatron's schedule, not a line of ``pipeline_parallel`` itself."""
    from megatron.core import pipeline_parallel

    _errors.user_source()  # sets up the package's own skip list first
    here = os.path.dirname(os.path.abspath(pipeline_parallel.__file__)) + os.sep
    if here not in _errors._SKIP_DIRS:
        _errors._SKIP_DIRS = (*_errors._SKIP_DIRS, here)


def p2p_communicator(config: Any, types: PipelineTypes, pp_group: Any = None) -> Any:
    """Megatron's ``P2PCommunicator`` for this stage, typed by ``types``; pass it to Megatron's schedule.

    ``config`` is the model's ``TransformerConfig``; ``pp_group`` defaults to
    ``parallel_state``'s pipeline group. Checked here, before any
    communication: the interleaved (virtual) pipeline is not built
    (``NotImplementedError``), a declaration per stage has one entry per stage,
    and on real processes every stage holds an equal declaration (one small
    all-gather over the pipeline group). The result is a
    ``TypedP2PCommunicator``, a subclass of Megatron's class: its sends are
    checked and its receives typed inside ``spmd.typecheck()``; outside, it is
    Megatron's communicator.

    Example::

        comm = spmd_megatron.p2p_communicator(config, spmd_megatron.PipelineTypes({"dp": spmd.V, "tp": spmd.I}))
        groups = ProcessGroupCollection.use_mpu_process_groups(["tp", "cp", "pp", "embd", "pos_embd", "dp_cp"])
        with spmd.set_current_mesh(spmd_megatron.mesh()), spmd.typecheck(), comm.iteration():
            forward_backward_pipelining_without_interleaving(..., p2p_communicator=comm, pg_collection=groups)
    """
    if not isinstance(types, PipelineTypes):
        raise TypeError(f"spmd_megatron.p2p_communicator: types is a spmd_megatron.PipelineTypes, got {types!r}")
    if getattr(config, "virtual_pipeline_model_parallel_size", None) is not None:
        raise NotImplementedError(
            "spmd_megatron.p2p_communicator: the interleaved (virtual) pipeline "
            f"(virtual_pipeline_model_parallel_size={config.virtual_pipeline_model_parallel_size}) is not typed: a "
            "rank runs several model chunks, each its own stage; use the non-interleaved schedule")
    if pp_group is None:
        from megatron.core import parallel_state as ps

        pp_group = ps.get_pipeline_model_parallel_group()
    n = pp_group.size()
    if n < 2:
        raise ValueError("spmd_megatron.p2p_communicator: the pipeline group has one rank, so there is no pipeline "
                         "(pipeline_model_parallel_size=1 runs forward_backward_no_pipelining)")
    if types.stages is not None and len(types.stages) != n:
        raise ValueError(f"spmd_megatron.p2p_communicator: the PipelineTypes declares {len(types.stages)} stages, "
                         f"but the pipeline group has {n}")
    _report_callers_of_megatron_pipeline()
    _agree(types, pp_group)
    comm = _communicator_class()(pp_group, config)
    comm._spmd_setup(types)
    return comm


def _agree(types: PipelineTypes, pp_group: Any) -> None:
    """On real processes: every stage's declaration equals this one (a fake group has one stage's program)."""
    if dist.get_backend(pp_group) == "fake":
        return
    mine = types.key(pp_group.size())
    theirs: list[Any] = [None] * pp_group.size()
    dist.all_gather_object(theirs, mine, group=pp_group)
    for stage, other in enumerate(theirs):
        if other != mine:
            k = next(i for i, (a, b) in enumerate(zip(mine, other)) if a != b)
            raise SpmdTypeError(
                Rejection(
                    "Every pipeline stage holds the same PipelineTypes: stage "
                    f"{pp_group.rank()} and stage {stage} declare different types for what stage {k} sends to "
                    f"stage {k + 1}.",
                    [(f"stage {pp_group.rank()} (this one)", mine[k]), (f"stage {stage}", other[k])],
                    ["build the PipelineTypes from the same code and config on every rank"],
                ),
                _errors.user_source_line(),
            )


_CLASS: list[type] = []


def _communicator_class() -> type:
    """``TypedP2PCommunicator``, made on first use (it subclasses Megatron's class, imported lazily)."""
    if not _CLASS:
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        _CLASS.append(type("TypedP2PCommunicator", (_StageChecks, P2PCommunicator), {
            "__doc__": _StageChecks.__doc__, "__module__": __name__}))
    return _CLASS[0]


def _each(tensors: Any) -> list[Any]:
    return list(tensors) if isinstance(tensors, list) else [tensors]


def _like(tensors: Any, items: list[Any]) -> Any:
    return items if isinstance(tensors, list) else items[0]


class _StageChecks:
    """Megatron's ``P2PCommunicator`` with typed sends and receives (made by :func:`p2p_communicator`).

    Every method of Megatron's class keeps its signature and behaviour; inside
    ``spmd.typecheck()`` a send is checked against the declared types before
    Megatron's send, and a received tensor is typed in place after it.
    :meth:`iteration` brackets one call of the schedule and checks that every
    received activation's gradient was sent back.

    Example::

        with comm.iteration():
            input_tensor = comm.recv_forward(shape, is_first_stage=False)   # typed as declared
            comm.send_backward(input_tensor.grad, is_first_stage=False)     # checked, then sent
    """

    def _spmd_setup(self, types: PipelineTypes) -> None:
        self.pipeline_types = types
        self.stage = self.pp_group.rank()  # type: ignore[attr-defined]
        self.n_stages = self.pp_group.size()  # type: ignore[attr-defined]
        self._pp_ranks = dist.get_process_group_ranks(self.pp_group)  # type: ignore[attr-defined]
        self._awaiting: deque[_Received] = deque()
        self._received = 0

    # -- the contract on the current mesh ------------------------------------------------

    def _types(self, boundary: int) -> TypeMap:
        """The type crossing ``boundary`` (stage b to b+1) on the current mesh, V on the pipeline axis."""
        mesh = current_mesh()
        if mesh is None:
            raise ValueError("spmd_megatron: no mesh is current: wrap the pipeline in "
                             "spmd.set_current_mesh(spmd_megatron.mesh())")
        try:
            names = resolve_axes(self.pp_group)  # type: ignore[attr-defined]
        except ValueError:
            names = ()
        if len(names) != 1:
            raise ValueError(f"spmd_megatron: the pipeline group (ranks {self._pp_ranks}) is not an axis of the "
                             f"current mesh (axes: {', '.join(mesh.axis_names)}); use "
                             "spmd.set_current_mesh(spmd_megatron.mesh())")
        pp = self._pp_name = names[0]
        out = {pp: V}
        for axis, t in self.pipeline_types.boundary(boundary, self.n_stages).items():
            named = resolve_axes(axis)
            if pp in named:
                raise ValueError(f"spmd_megatron.PipelineTypes: leave the pipeline axis {pp!r} out of the types: "
                                 "an activation is V there (each stage holds its own)")
            out.update({n: t for n in named})
        missing = [a for a in mesh.typed_axes if a not in out]
        if missing:
            raise ValueError(f"spmd_megatron.PipelineTypes: what stage {boundary} sends to stage {boundary + 1} "
                             f"names no type on axis {missing[0]!r} of the current mesh; name one, e.g. "
                             f"{{{missing[0]!r}: spmd.V, ...}}")
        return TypeMap.of(out, mesh.space)

    # -- sends: checked, then unwrapped for Megatron --------------------------------------

    def _send(self, tensors: Any, forward: bool, skip: bool) -> Any:
        """Check what this stage sends (forward: to the next stage; backward: to the previous) and unwrap it."""
        if skip or not STATE.checking:
            return tensors
        k = self.stage
        if forward and k == self.n_stages - 1:
            raise ValueError(f"spmd_megatron: stage {k} is the last stage: it sends nothing forward "
                             "(pass is_last_stage=True); Megatron would send to stage 0")
        if not forward and k == 0:
            raise ValueError("spmd_megatron: stage 0 is the first stage: it sends no gradient back "
                             f"(pass is_first_stage=True); Megatron would send to stage {self.n_stages - 1}")
        want = self._types(k) if forward else self._types(k - 1).backward()
        out = []
        for t in _each(tensors):
            if forward and t is None:
                raise _missing_activation(k)
            if not forward:
                received = self._awaiting.popleft() if self._awaiting else None
                if t is None:
                    raise _missing_gradient(k, received, sent_none=True)
            self._check_sent(t, want, forward)
            out.append(unwrap(t))
        return _like(tensors, out)

    def _check_sent(self, t: torch.Tensor, want: TypeMap, forward: bool) -> None:
        have = getattr(t, "_spmd_types", None)
        k = self.stage
        to = k + 1 if forward else k - 1
        order = current_mesh().axis_names  # type: ignore[union-attr]
        if have is None:
            raise SpmdTypeError(
                Rejection(
                    f"A pipeline stage sends typed tensors: stage {k} sends an untyped "
                    f"{'activation' if forward else 'gradient'} to stage {to}, so its type there is unknown.",
                    [("sent", f"stage {k}: {format_tensor_type(t, None)}"), ("declared", want.format(order))],
                    [f"spmd.assert_type({'output' if forward else 'grad'}, {want.code()})"],
                ),
                _errors.user_source_line(),
            )
        ndim = t.dim()
        for axis in order:
            w = want.get(axis)
            if w is not None and not compatible(have.get(axis), w, ndim):
                raise _sent_mismatch(k, to, forward, format_tensor_type(t, have), want, axis, have.get(axis), order,
                                     pipeline_axis=axis == self._pp_name)

    # -- receives: the type known before the communication, given after ------------------

    def _expect(self, forward: bool, skip: bool) -> TypeMap | None:
        """What this stage is about to receive (forward: an activation; backward: a gradient), or None."""
        if skip or not STATE.checking:
            return None
        k = self.stage
        if forward and k == 0:
            raise ValueError(f"spmd_megatron: stage 0 is the first stage: nothing is sent to it forward "
                             f"(pass is_first_stage=True); Megatron would receive from stage {self.n_stages - 1}")
        if not forward and k == self.n_stages - 1:
            raise ValueError(f"spmd_megatron: stage {k} is the last stage: no gradient comes back to it "
                             "(pass is_last_stage=True); Megatron would receive from stage 0")
        return self._types(k - 1) if forward else self._types(k).backward()

    def _typed(self, tensors: Any, types: TypeMap | None, forward: bool) -> Any:
        if types is None or tensors is None:
            return tensors
        for t in _each(tensors):
            if t is None:
                continue
            type_in_place(t, types)
            if forward and torch.is_grad_enabled() and t.requires_grad:
                self._awaiting.append(_Received(self._received, format_tensor_type(t, types),
                                                _errors.user_source_line()))
            self._received += forward
        return tensors

    # -- Megatron's methods --------------------------------------------------------------

    def send_forward(self, output_tensors: Any, is_last_stage: bool) -> None:
        """Megatron's ``send_forward``, the activation checked against what the next stage receives."""
        return super().send_forward(self._send(output_tensors, True, is_last_stage), is_last_stage)  # type: ignore[misc]

    def send_backward(self, input_tensor_grads: Any, is_first_stage: bool) -> None:
        """Megatron's ``send_backward``, the gradient checked against the dual of what this stage received."""
        return super().send_backward(self._send(input_tensor_grads, False, is_first_stage), is_first_stage)  # type: ignore[misc]

    def recv_forward(self, tensor_shapes: Any, is_first_stage: bool) -> Any:
        """Megatron's ``recv_forward``, the activation typed as the previous stage sends it (V on the pipeline axis)."""
        types = self._expect(True, is_first_stage)
        return self._typed(super().recv_forward(tensor_shapes, is_first_stage), types, True)  # type: ignore[misc]

    def recv_backward(self, tensor_shapes: Any, is_last_stage: bool) -> Any:
        """Megatron's ``recv_backward``, the gradient typed as the dual of what this stage sent."""
        types = self._expect(False, is_last_stage)
        return self._typed(super().recv_backward(tensor_shapes, is_last_stage), types, False)  # type: ignore[misc]

    def send_forward_recv_backward(self, output_tensors: Any, tensor_shapes: Any, is_last_stage: bool) -> Any:
        """Megatron's ``send_forward_recv_backward``: the send checked, the received gradient typed."""
        sent, types = self._send(output_tensors, True, is_last_stage), self._expect(False, is_last_stage)
        got = super().send_forward_recv_backward(sent, tensor_shapes, is_last_stage)  # type: ignore[misc]
        return self._typed(got, types, False)

    def send_backward_recv_forward(self, input_tensor_grads: Any, tensor_shapes: Any, is_first_stage: bool) -> Any:
        """Megatron's ``send_backward_recv_forward``: the gradient checked, the received activation typed."""
        sent, types = self._send(input_tensor_grads, False, is_first_stage), self._expect(True, is_first_stage)
        got = super().send_backward_recv_forward(sent, tensor_shapes, is_first_stage)  # type: ignore[misc]
        return self._typed(got, types, True)

    def send_forward_recv_forward(self, output_tensor: Any, recv_prev: bool, tensor_shape: Any,
                                  overlap_p2p_comm: bool = False) -> Any:
        """Megatron's ``send_forward_recv_forward``: the activation checked, the next one received typed."""
        # here, as in Megatron's interleaved schedule, None is nothing to send
        sent, types = self._send(output_tensor, True, output_tensor is None), self._expect(True, not recv_prev)
        got = super().send_forward_recv_forward(sent, recv_prev, tensor_shape, overlap_p2p_comm)  # type: ignore[misc]
        if overlap_p2p_comm:
            return self._typed(got[0], types, True), got[1]
        return self._typed(got, types, True)

    def send_backward_recv_backward(self, input_tensor_grad: Any, recv_next: bool, tensor_shape: Any,
                                    overlap_p2p_comm: bool = False) -> Any:
        """Megatron's ``send_backward_recv_backward``: the gradient checked, the next one received typed."""
        first = self.stage == 0 and input_tensor_grad is None
        sent, types = self._send(input_tensor_grad, False, first), self._expect(False, not recv_next)
        got = super().send_backward_recv_backward(sent, recv_next, tensor_shape, overlap_p2p_comm)  # type: ignore[misc]
        if overlap_p2p_comm:
            return self._typed(got[0], types, False), got[1]
        return self._typed(got, types, False)

    def send_forward_backward_recv_forward_backward(self, output_tensor: Any, input_tensor_grad: Any,
                                                    recv_prev: bool, recv_next: bool, tensor_shape: Any) -> Any:
        """Megatron's ``send_forward_backward_recv_forward_backward``: both sends checked, both receives typed."""
        sent_f = self._send(output_tensor, True, output_tensor is None)
        sent_b = self._send(input_tensor_grad, False, self.stage == 0 and input_tensor_grad is None)
        types_f, types_b = self._expect(True, not recv_prev), self._expect(False, not recv_next)
        got_f, got_b = super().send_forward_backward_recv_forward_backward(  # type: ignore[misc]
            sent_f, sent_b, recv_prev, recv_next, tensor_shape)
        return self._typed(got_f, types_f, True), self._typed(got_b, types_b, False)

    # -- one call of the schedule --------------------------------------------------------

    @contextlib.contextmanager
    def iteration(self, forward_only: bool = False) -> Iterator[None]:
        """One call of the schedule: every activation received inside must have its gradient sent back by its end.

        ``forward_only=True`` (evaluation) expects no gradient. A received
        activation whose gradient is never sent leaves the previous stage waiting
        for it (a hang) and its layers without a gradient: an ``SpmdTypeError``
        at the end of the block, naming the micro-batch and where it was received.

        Example::

            with spmd.typecheck(), comm.iteration():
                forward_backward_pipelining_without_interleaving(..., p2p_communicator=comm, pg_collection=groups)
        """
        self._awaiting.clear()
        self._received = 0
        try:
            yield
            if self._awaiting and not forward_only:
                raise _missing_gradient(self.stage, self._awaiting[0], sent_none=False, waiting=len(self._awaiting))
        finally:
            self._awaiting.clear()


# ---------------------------------------------------------------------------
# messages


def _sent_mismatch(k: int, to: int, forward: bool, shown: str, want: TypeMap, axis: str,
                   have: SpmdType | None, order: Sequence[str], pipeline_axis: bool = False) -> SpmdTypeError:
    w = want.get(axis)
    x = "output" if forward else "grad"
    if forward:
        rule = (f"What a pipeline stage sends is what the next stage receives: stage {k} sends {have} on {axis!r} "
                f"to stage {to}, which receives {w} there.")
        declared = ("declared", f"stage {to} receives {want.format(order)}")
    else:
        rule = (f"A pipeline stage sends back the gradient type of what it received: stage {k} received "
                f"{want.backward().format(order)} from stage {to}, so the gradient it sends back is {w} on "
                f"{axis!r}, not {have}.")
        declared = ("declared", f"stage {to} expects the gradient {want.format(order)}")
    fixes = []
    if pipeline_axis:  # the value on this stage is what crosses: an R value's gradient comes back as its P share
        fixes = [f"spmd.reinterpret({x}, '{axis}', src=spmd.R, dst=spmd.V)"] if have is R else []
    elif have is not None:
        sequence = forward and have.is_varying and w in (I, R) and axis == _tp_axis()
        fixes.append(conversion(x, axis, S(0) if sequence else have, w))  # Megatron's shard between stages: dim 0
        if forward:  # the declaration names every axis but the pipeline axis
            fixes.append(f"declare what crosses: spmd_megatron.PipelineTypes({{..., '{axis}': "
                         f"{(S(0) if sequence else have).code()}}}), if stage {to} takes that")
    return SpmdTypeError(
        Rejection(rule, [("sent", f"stage {k}: {shown}"), declared, ("axis", f"'{axis}': {have} is not {w}")], fixes),
        _errors.user_source_line(),
    )


def _tp_axis() -> str | None:
    from megatron.core import parallel_state as ps

    try:
        names = resolve_axes(ps.get_tensor_model_parallel_group())
    except (AssertionError, ValueError, RuntimeError):
        return None
    return names[0] if len(names) == 1 else None


def _missing_activation(k: int) -> SpmdTypeError:
    return SpmdTypeError(
        Rejection(
            f"A pipeline stage sends the next stage an activation for every micro-batch: stage {k} sends None to "
            f"stage {k + 1}, so Megatron sends nothing and stage {k + 1} waits for it.",
            [("sent", f"stage {k}: None")],
            ["comm.send_forward(output_tensor, is_last_stage=False) with this micro-batch's output",
             "is_last_stage=True on the last stage only"],
        ),
        _errors.user_source_line(),
    )


def _missing_gradient(k: int, received: _Received | None, sent_none: bool, waiting: int = 1) -> SpmdTypeError:
    what = (f"micro-batch {received.micro_batch}'s activation {received.shown}" if received is not None
            else "an activation")
    if sent_none:
        rule = (f"A pipeline stage sends back the gradient of every activation it received: stage {k} sends None "
                f"to stage {k - 1} for {what}, so stage {k - 1} gets no gradient (Megatron sends nothing, and stage "
                f"{k - 1} waits for it).")
        fixes = ["use the received activation in this stage's forward: model.set_input_tensor(input_tensor), and "
                 "GPTModel(pre_process=False) on every stage but the first"]
    else:
        rule = (f"A pipeline stage sends back the gradient of every activation it received: stage {k} received "
                f"{waiting} activation{'s' if waiting > 1 else ''} from stage {k - 1} whose gradient it never sent "
                f"back, so stage {k - 1} waits for {'them' if waiting > 1 else 'it'} and its backward never runs.")
        fixes = ["comm.send_backward(input_tensor.grad, is_first_stage=False) after each micro-batch's backward "
                 "(Megatron's schedules do)",
                 "comm.iteration(forward_only=True) if no backward is meant"]
    seen = [("received", f"stage {k} from stage {k - 1}: {what}")]
    if received is not None and received.where:
        seen.append(("received at", received.where))
    return SpmdTypeError(Rejection(rule, seen, fixes), _errors.user_source_line())
