"""Typecheck unmodified Megatron-core code: its autograd Functions, its process groups, its parameters.

The public face of the adapter in ``spmd_types/integrations/megatron/``. Three calls,
made once after ``parallel_state.initialize_model_parallel``::

    from spmd_types import megatron as spmd_megatron

    spmd_megatron.register()                  # Megatron-core's autograd Functions, with their types
    mesh = spmd_megatron.mesh()               # {"dp": group, "tp": group, ...} from parallel_state
                                              # (mesh(expert=True): edp, ep, etp, current inside MoE layers)
    with spmd.set_current_mesh(mesh), spmd.typecheck():
        spmd_megatron.type_parameters(model)  # every parameter typed from Megatron's own attributes
        loss = model(tokens, position_ids, attention_mask, labels=labels)

Pipeline stages: ``PipelineTypes`` declares the types that cross between
stages, ``p2p_communicator(config, types)`` is Megatron's ``P2PCommunicator``
for this stage with its sends checked and its receives typed (pass it to
Megatron's schedule), and ``type_parameters`` types every stage's parameters on
``pp``.

``megatron.core`` is imported only when one of these is called; importing this
module does not import it. See docs/megatron_core.md.
"""

from .integrations.megatron.adapter import (
    FUNCTIONS,
    axes_of_group,
    axis_of_group,
    mesh,
    parameter_types,
    register,
    track_grad_sync,
    type_parameters,
)
from .integrations.megatron.moe import expert_parameter_types, layer_mesh
from .integrations.megatron.pipeline import PipelineTypes, StageTypes, p2p_communicator, parameter_type_on_pp

__all__ = ["register", "mesh", "type_parameters", "parameter_types", "expert_parameter_types", "layer_mesh",
           "axis_of_group", "axes_of_group", "track_grad_sync", "FUNCTIONS", "PipelineTypes", "StageTypes",
           "p2p_communicator", "parameter_type_on_pp"]
