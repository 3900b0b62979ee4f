"""A checkpoint value loaded into a typed tensor: the two types must agree (``load_state_dict``, ``copy_``)."""

from __future__ import annotations

from .._core.errors import Rejection, SpmdTypeError
from .._core.types import TypeMap, V

__all__ = ["check_loaded_type"]


def check_loaded_type(what: str, loaded: TypeMap | None, live: TypeMap | None) -> None:
    """Raise if ``loaded`` (a checkpoint value's types) differs from ``live`` (the tensor it goes into).

    Either side untyped passes: a plain checkpoint carries no types to check.
    V and S(d) match each other, as in ``assert_type``.
    """
    if loaded is None or live is None or loaded is live:
        return
    for axis in dict.fromkeys(live.axes() + loaded.axes()):
        have, want = loaded.get(axis), live.get(axis)
        if have is want or (have is not None and want is not None and have.is_varying and want.is_varying
                            and (have is V or want is V)):
            continue
        raise SpmdTypeError(
            Rejection(
                f"Loading a value of another type: {what} is {have} on axis '{axis}', and the tensor it is "
                f"loaded into is {want}.",
                [("loaded", loaded.format()), ("into", live.format()), ("axis", f"'{axis}': {have} is not {want}")],
                ["save and load with the same types (a checkpoint keeps the types it was saved with)"],
            ),
            None,
        )
