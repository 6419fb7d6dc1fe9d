# nbgrader configuration of a course built from "Lightning Attention, from the Math to the Kernel".
# `python -m lightning_edu.assignments course DIR --chapters ...` writes it into the course folder DIR (the
# course root: run nbgrader there). INSTRUCTORS.md explains each step.
c = get_config()  # noqa: F821 - nbgrader's config loader defines get_config

# One assignment per chapter: source/chNN/NN_name.ipynb, released into release/chNN/.
c.CourseDirectory.source_directory = "source"
c.CourseDirectory.release_directory = "release"
# c.CourseDirectory.course_id = "lightning-attention"   # release_assignment and collect need it
# c.Exchange.root = "/srv/nbgrader/exchange"             # where release_assignment puts the students' copies

# The chapters' markers (nbgrader's defaults, stated so that another default cannot break them). nbgrader acts
# on them anywhere in a cell, markdown too, so the chapters write them only in answer and check cells.
c.ClearSolutions.begin_solution_delimeter = "BEGIN SOLUTION"
c.ClearSolutions.end_solution_delimeter = "END SOLUTION"
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
c.ClearSolutions.enforce_metadata = True
c.ClearHiddenTests.begin_test_delimeter = "BEGIN HIDDEN TESTS"
c.ClearHiddenTests.end_test_delimeter = "END HIDDEN TESTS"

# Autograding runs a chapter top to bottom: 3 to 45 s a chapter on a 2-core CPU, the Triton chapters (07-09)
# included, whose kernels run in the CPU interpreter without a GPU. Each check stops a call of the student's
# function after 60 s and itself after 240 s (LIGHTNING_EDU_CALL_TIME_LIMIT, LIGHTNING_EDU_CHECK_TIME_LIMIT in the
# environment of `nbgrader autograde` change them); a cell is interrupted after 10 minutes.
c.Execute.timeout = 600
c.Execute.interrupt_on_timeout = True

# Grading what survives (INSTRUCTORS.md): a check cell deleted from a submission is put back and graded, and the
# log names a check cell that was deleted or edited (not the hidden tests, which every check cell gets back); a
# kernel that dies in a cell is restarted, the cells before it run again, and the cells after it are graded.
c.Autograde.sanitize_preprocessors = [
    "nbgrader.preprocessors.ClearOutput",
    "nbgrader.preprocessors.DeduplicateIds",
    "nbgrader.preprocessors.OverwriteKernelspec",
    "lightning_edu.assignments.OverwriteCheckCells",
    "nbgrader.preprocessors.CheckCellMetadata",
]
c.Autograde.autograde_preprocessors = [
    "lightning_edu.assignments.ExecuteSurviving",
    "nbgrader.preprocessors.IgnorePattern",
    "nbconvert.preprocessors.ClearMetadataPreprocessor",
    "nbgrader.preprocessors.LimitOutput",
    "nbgrader.preprocessors.SaveAutoGrades",
    "nbgrader.preprocessors.AssignLatePenalties",
    "nbgrader.preprocessors.CheckCellMetadata",
]
