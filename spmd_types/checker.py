"""The published API's ``spmd_types.checker``: turning checking on.

Example::

    from spmd_types.checker import typecheck
    with typecheck(local=False):      # global SPMD, as torchtitan checks
        loss = model(tokens)
"""

from ._boundaries.local_map import local_map
from ._boundaries.no_typecheck import no_typecheck
from ._checker.asserts import typecheck
from ._core.state import is_type_checking

__all__ = ["typecheck", "is_type_checking", "local_map", "no_typecheck", "SpmdTypeMode"]


class SpmdTypeMode:
    """The published package's checker, a ``TorchFunctionMode``: **not built** here.

    Checking here is :func:`typecheck` over typed tensors (``spmd.LTensor``),
    not a dispatch mode, so there is no mode object to construct or push.

    Example::

        with typecheck():      # instead of SpmdTypeMode()
            ...
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError(
            "spmd_types.checker.SpmdTypeMode is not built: checking here is spmd.typecheck() over typed tensors "
            "(spmd.LTensor), not a TorchFunctionMode; use `with spmd.typecheck():`"
        )
