"""Every private torch name the package uses (``spmd_types/_torch/private.py``) exists on this torch.

The test suite runs on each supported release (2.13.0 and 2.14.1), so a release
that moves one of them fails here, by name, instead of as an import error in a
user's job.
"""

from __future__ import annotations

import pytest

from spmd_types._torch.private import NAMES


@pytest.mark.parametrize("name", sorted(NAMES))
def test_the_private_name_exists_on_this_torch(name):
    assert NAMES[name]() is not None, name
