"""The typed tensor and the regions that turn checking on.

``spmd_types._checker.typecheck`` is also a path torch 2.14 imports (DTensor's
``local_map(spmd_types=True)`` calls ``typecheck(strict_mode="strict")``).
"""

from .asserts import typecheck

__all__ = ["typecheck"]
