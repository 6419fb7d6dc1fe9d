"""Automatic checks for the exercises, one module per chapter (``ch01``, ``ch02``, ...).

Each exercise in a notebook is a spec (a reference in the package), a stub the reader fills between the
solution markers, and a ``check_...`` call from here, in a cell of its own. A check draws random inputs of odd
shapes (fixed ones by default, fresh ones with ``seed=None``, as a grader's hidden test does), compares, and
either prints what passed or raises :class:`ExerciseError` saying what differs and where ("dk differs in block
2, rows 32-47: ..."), not just "False". A check also refuses an answer that calls the package's own
implementation of what the exercise asks for (:class:`IntegrityError`), from any thread or process, and never
crashes on what the reader's function returns or does: each check runs in a process of its own, where a crash or
a call that never returns fails that exercise with a message (``_isolation``).
"""

from ._core import ExerciseError, IntegrityError, exercise, expect_close, expect_shape, passed

__all__ = ["ExerciseError", "IntegrityError", "exercise", "expect_close", "expect_shape", "passed"]
