"""Automatic checks for the exercises, one module per chapter (``ch01``, ``ch02``, ...).

Each exercise in a notebook is a spec (a reference in the package), a stub the reader fills between
``### BEGIN SOLUTION`` and ``### END SOLUTION``, and one ``check_...`` call from here. A check draws seeded
random inputs of odd shapes, compares, and either prints what passed or raises :class:`ExerciseError`
saying what differs and where ("dk differs in block 2, rows 32-47: ..."), not just "False".
"""

from ._core import ExerciseError, expect_close, expect_shape, passed

__all__ = ["ExerciseError", "expect_close", "expect_shape", "passed"]
