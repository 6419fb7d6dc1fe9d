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

# Autograding runs a chapter top to bottom. Without a GPU the Triton chapters (07-09) run their kernels in the
# CPU interpreter: minutes for some cells.
c.Execute.timeout = 1800
c.Execute.interrupt_on_timeout = True
