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

__all__ = ["typecheck", "is_type_checking", "local_map", "no_typecheck"]
