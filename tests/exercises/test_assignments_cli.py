"""``python -m lightning_edu.assignments`` refusing what it cannot do: one line naming the problem, exit status 2,
and nothing left behind (no notebook rewritten, no course folder or file created). Fast: no nbgrader here (the
course pipeline lives in tests/exercises/test_assignments.py)."""

from __future__ import annotations

import builtins
import errno

import nbformat
import pytest

from lightning_edu import assignments
from course_fixtures import chapter_four


@pytest.fixture
def chapter(tmp_path):
    path = tmp_path / "04_x.ipynb"
    nbformat.write(chapter_four(), str(path))
    return path


def _refused(capsys, argv, *fragments) -> str:
    """Run the command: it must return 2 and print exactly one line, to stderr, holding every fragment."""
    assert assignments.main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("item, fragment", [
    ("4.1=abc", "with P a number"), ("4.1=", "takes N.k=P"), ("4.1", "takes N.k=P"), ("x=2", "takes N.k=P"),
    ("4.1=-1", "finite number >= 0"), ("4.1=-0.5", "finite number >= 0"), ("4.1=nan", "finite number >= 0"),
    ("4.1=inf", "finite number >= 0"),
])
def test_points_that_are_not_a_number_of_points_are_refused(capsys, chapter, item, fragment):
    before = chapter.read_bytes()
    _refused(capsys, ["normalise", str(chapter), "--points", item], fragment, repr(item))
    assert chapter.read_bytes() == before


def test_points_for_an_exercise_twice_are_refused(capsys, chapter):
    _refused(capsys, ["normalise", str(chapter), "--points", "4.1=2", "4.1=3"], "4.1 twice")


def test_points_for_an_exercise_the_chapter_lacks_or_another_chapter_has_are_refused(capsys, chapter):
    before = chapter.read_bytes()
    _refused(capsys, ["normalise", str(chapter), "--points", "4.9=2"], "04_x.ipynb", "'4.9'")
    _refused(capsys, ["normalise", str(chapter), "--points", "4.1=2", "5.1=2"], "5.1", "(04)")
    assert chapter.read_bytes() == before
    assert assignments.main(["normalise", str(chapter), "--points", "4.1=0", "4.2=2.5"]) == 0  # zero is a score
    assert [c.metadata.nbgrader["points"] for c in nbformat.read(str(chapter), 4).cells
            if c.metadata.get("nbgrader", {}).get("grade")] == [0, 2.5]


@pytest.mark.parametrize("text, fragment", [
    (None, "no such notebook"), ("not json", "not JSON"), ("{}", "not a valid notebook"),
    ("[]", "not a valid notebook"), (b"\xff\xfe", "not UTF-8"),
], ids=["missing", "text", "empty object", "a list", "bytes"])
@pytest.mark.parametrize("command", ["normalise", "points"])
def test_a_missing_or_unreadable_notebook_is_one_line(capsys, tmp_path, chapter, command, text, fragment):
    """Beside a good chapter: the bad one is named, and the good one is not rewritten either."""
    bad = tmp_path / "04_bad.ipynb"
    if isinstance(text, bytes):
        bad.write_bytes(text)
    elif text is not None:
        bad.write_text(text)
    before = chapter.read_bytes()
    _refused(capsys, [command, str(chapter), str(bad)], str(bad), fragment)
    assert chapter.read_bytes() == before


def test_a_folder_or_a_notebook_without_exercises_is_one_line(capsys, tmp_path):
    _refused(capsys, ["normalise", str(tmp_path)], "a folder, not a notebook")
    plain = tmp_path / "04_plain.ipynb"
    nbformat.write(nbformat.v4.new_notebook(), str(plain))
    _refused(capsys, ["points", str(plain)], "04_plain.ipynb", "'## Exercises'")
    _refused(capsys, ["normalise", str(plain)], "04_plain.ipynb: not normalisable")


def _only_writing(monkeypatch, fails):
    """Make ``open`` in lightning_edu.assignments fail for writing a path that ``fails(path)`` picks, as on a
    read-only file system (this runs as root, where a folder's mode bits stop nothing)."""
    def fake_open(file, mode="r", *args, **kwargs):
        if any(m in mode for m in "wxa") and fails(str(file)):
            raise OSError(errno.EROFS, "Read-only file system", str(file))
        return builtins.open(file, mode, *args, **kwargs)

    monkeypatch.setattr(assignments, "open", fake_open, raising=False)


def test_a_normalise_that_cannot_write_puts_back_what_it_wrote(capsys, monkeypatch, tmp_path, chapter):
    second = tmp_path / "04_y.ipynb"
    nbformat.write(chapter_four(), str(second))
    before = chapter.read_bytes(), second.read_bytes()
    _only_writing(monkeypatch, lambda path: path == str(second))
    _refused(capsys, ["normalise", str(chapter), str(second)], "cannot write", str(second), "Read-only file system")
    assert (chapter.read_bytes(), second.read_bytes()) == before


# ------------------------------------------------------------------------------------------- course


def test_a_refused_course_leaves_nothing_behind(capsys, tmp_path):
    course = tmp_path / "course"
    _refused(capsys, ["course", str(course), "--chapters", "03", "99"], "no chapter '99'")
    _refused(capsys, ["course", str(course), "--chapters", "03", "--points", "3.9=2"], "03_decay.ipynb", "'3.9'")
    _refused(capsys, ["course", str(course), "--chapters", "03", "--points", "4.1=2"], "4.1", "(03)")
    _refused(capsys, ["course", str(course), "--chapters", "03", "--points", "3.1=abc"], "'3.1=abc'")
    assert not course.exists()


def test_a_course_folder_that_is_a_file_is_refused(capsys, tmp_path):
    target = tmp_path / "course"
    target.write_text("notes")
    _refused(capsys, ["course", str(target), "--chapters", "03"], f"{target} is a file, not a folder")
    _refused(capsys, ["course", str(target / "inner"), "--chapters", "03"], f"{target} is a file, not a folder")
    assert target.read_text() == "notes"


def test_a_course_that_cannot_write_takes_back_its_files_and_folders(capsys, monkeypatch, tmp_path):
    """nbgrader_config.py is written first; the chapter's notebook then fails: both, and the folders made for
    them, are gone afterwards. A folder that was there before stays, with what it held."""
    _only_writing(monkeypatch, lambda path: path.endswith(".ipynb"))
    course = tmp_path / "new"
    _refused(capsys, ["course", str(course), "--chapters", "03"], "cannot write", "03_decay.ipynb",
             "Read-only file system")
    assert not course.exists()
    kept = tmp_path / "kept"
    (kept / "source").mkdir(parents=True)
    (kept / "source" / "notes.txt").write_text("mine")
    _refused(capsys, ["course", str(kept), "--chapters", "03"], "Read-only file system")
    assert sorted(p.relative_to(kept).as_posix() for p in kept.rglob("*")) == ["source", "source/notes.txt"]


def test_nbgrader_commands_start_from_the_sessions_environment_not_the_one_of_the_moment(monkeypatch, tmp_path):
    """The course pipeline starts nbgrader beside the other tests, which change os.environ for a while (a guarded
    check puts its sentinels on PYTHONPATH; tests set one-second time limits): a command started then must not
    inherit them."""
    import course_fixtures

    seen = {}

    class Recorder:
        def __init__(self, args, **kwargs):
            seen.update(kwargs["env"])

    monkeypatch.setattr(course_fixtures.subprocess, "Popen", Recorder)
    monkeypatch.setenv("LIGHTNING_EDU_CALL_TIME_LIMIT", "1")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "sentinels"))
    course_fixtures.nbgrader_at(tmp_path, "--version", env={"ADDED": "yes"})
    assert seen.get("LIGHTNING_EDU_CALL_TIME_LIMIT") == course_fixtures._ENVIRONMENT.get("LIGHTNING_EDU_CALL_TIME_LIMIT")
    assert seen.get("PYTHONPATH") == course_fixtures._ENVIRONMENT.get("PYTHONPATH")
    assert seen["ADDED"] == "yes"
