"""The two exceptions every exercise check raises, in a module of their own.

:mod:`._core` (the checks' machinery) and :mod:`._integrity` (the check that the reader wrote the algorithm)
both raise them, and ``_core`` runs ``_integrity``: keeping the exceptions here lets each import them without
the two importing each other. Import them from :mod:`lightning_edu.exercises` (or ``._core``, which
re-exports them).
"""

from __future__ import annotations

__all__ = ["ExerciseError", "IntegrityError"]


class ExerciseError(AssertionError):
    """Raised by a check with a message that says what is wrong and where."""


class IntegrityError(ExerciseError):
    """The reader's function calls the package's implementation instead of writing the algorithm."""
