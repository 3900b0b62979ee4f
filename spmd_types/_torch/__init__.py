"""torch's private names, in one room: the only place in the package that reaches into them.

``private.py`` names each one once, with what it is for. A torch release that
moves one is then one edit here and one failing test in
``tests/test_torch_private.py`` (which loads every name on each supported
release), not an import error in a user's job.
"""
