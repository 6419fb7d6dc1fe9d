"""Each check runs in a process of its own, and each call of the reader's function has a time limit.

:func:`run_check` runs a check (the whole of it: the reader's calls, the comparisons, the messages) in a child
process forked from the notebook's, so that it sees the reader's functions and everything the notebook defined,
and so that whatever the reader's code does there stays there:

* a crash (a segmentation fault, ``os._exit``, the system killing the process when memory runs out) fails this
  exercise with a message saying so, and the notebook's kernel, with the other exercises, goes on;
* a call of the reader's function that has not returned after :func:`call_time_limit` seconds (60 by default,
  ``LIGHTNING_EDU_CALL_TIME_LIMIT``) is stopped, and the message names the function and its arguments; a check
  as a whole is stopped after :func:`check_time_limit` seconds (240, ``LIGHTNING_EDU_CHECK_TIME_LIMIT``), which
  bounds a Triton kernel of the reader's that never ends;
* the package's implementations are switched off in that process (:mod:`._integrity`) for every thread, and
  the processes started from it meet sentinels (:mod:`._sentinels`); the processes the reader's code leaves
  behind are ended with the check.

What the check and the reader's function print is captured there and printed here, in order, once the check is
over; its ``Correct: ...`` line and its :class:`ExerciseError` are the same as in the notebook's process.

Where the child cannot be used, the check runs in the notebook's process as before, with the same time limit on
each call (an exception raised in the running call, which stops Python code, not a loop inside compiled code):
where ``os.fork`` is not available or not safe (not Linux), where CUDA is initialised in the notebook's process
(a forked child cannot use it: the GPU runs of chapters 07-09), and where ``LIGHTNING_EDU_CHECK_ISOLATION=0``.
:func:`in_process_reason` says which.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import io
import mmap
import os
import pickle
import select
import signal
import struct
import sys
import threading
import time
import warnings

from ._errors import ExerciseError, IntegrityError

__all__ = ["run_check", "reader_call", "call_time_limit", "check_time_limit", "in_process_reason", "in_child",
           "CALL_TIME_LIMIT", "CHECK_TIME_LIMIT"]

CALL_LIMIT_ENV = "LIGHTNING_EDU_CALL_TIME_LIMIT"
CHECK_LIMIT_ENV = "LIGHTNING_EDU_CHECK_TIME_LIMIT"
ISOLATION_ENV = "LIGHTNING_EDU_CHECK_ISOLATION"
CALL_TIME_LIMIT = 60.0  # seconds one call of the reader's function may take; the honest answers take under 5
CHECK_TIME_LIMIT = 240.0  # seconds one check may take; whole chapters take 3 to 45 s on a 2-core CPU. Two checks
# (a cell's visible and hidden ones) fit in the 600 s of a cell in the course's nbgrader_config.py
_GRACE = 5.0  # after a call's limit, how long the child has to stop the call itself before it is killed
_OUTPUT_LIMIT = 200_000  # characters of the child's stdout (and of its stderr) printed here
_SHARED = 4096  # bytes: struct "<d" (the running call's start, time.monotonic; 0 when none), then its description
_DESCRIPTION_AT, _DESCRIPTION_SIZE = 16, 4000

_CHILD: mmap.mmap | None = None  # in the child process: the memory shared with the parent
_READERS_IMPORTS: set[str] = set()  # in the child: the modules imported while the reader's function ran


class CallTimeout(BaseException):
    """Raised in the thread of a call of the reader's function that ran past its limit (not an Exception: the
    reader's ``except Exception`` does not swallow it)."""


def _limit(env: str, default: float) -> float:
    text = os.environ.get(env, "").strip()
    if text:
        try:
            value = float(text)
        except ValueError:
            return default
        if value > 0 and value == value:
            return value
    return default


def call_time_limit() -> float:
    """Seconds one call of the reader's function may take: ``LIGHTNING_EDU_CALL_TIME_LIMIT``, else 60."""
    return _limit(CALL_LIMIT_ENV, CALL_TIME_LIMIT)


def check_time_limit() -> float:
    """Seconds one check may take in its process: ``LIGHTNING_EDU_CHECK_TIME_LIMIT``, else 240."""
    return _limit(CHECK_LIMIT_ENV, CHECK_TIME_LIMIT)


def in_child() -> bool:
    """Whether this process is the child of a check (:func:`run_check`)."""
    return _CHILD is not None


def in_process_reason() -> str | None:
    """Why a check runs in the notebook's own process, or None when it runs in a child process."""
    if _CHILD is not None:
        return "already in a check's process"
    if os.environ.get(ISOLATION_ENV, "").strip() in ("0", "false", "no", "off"):
        return f"{ISOLATION_ENV}=0"
    if not hasattr(os, "fork") or not sys.platform.startswith("linux"):
        return "a fork of the notebook's process is safe on Linux only"
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            return "CUDA is initialised in the notebook's process, and a forked child cannot use it"
    except Exception:  # noqa: BLE001 - a torch without CUDA support
        pass
    return None


# ------------------------------------------------------------------------------------------- one call


def describe(args, kwargs=None, limit: int = 300) -> str:
    """The arguments of a call, as a message names them: arrays by their shape, the rest by a short repr."""
    def one(value) -> str:
        shape = getattr(value, "shape", None)
        if shape is not None and getattr(value, "ndim", 0):
            return f"an array of shape {tuple(shape)}"
        if isinstance(value, (list, tuple)) and len(value) > 8:
            return f"a {type(value).__name__} of {len(value)} items"
        return _short(value)

    text = ", ".join([one(v) for v in args] + [f"{k}={one(v)}" for k, v in (kwargs or {}).items()])
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _short(value, limit: int = 60) -> str:
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001
        text = object.__repr__(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _timeout_message(label: str, limit: float, description: str) -> str:
    where = f" (called with {description})" if description else ""
    return (f"your function {label} did not return within {limit:g} s{where}: an endless loop, or a loop far slower "
            f"than the exercise needs (the model answer takes well under a second). The check stops a call after "
            f"{limit:g} s")


def _set_async(ident: int, exc) -> None:
    """Raise ``exc`` in the thread ``ident`` at its next Python instruction."""
    set_async = ctypes.pythonapi.PyThreadState_SetAsyncExc
    set_async.argtypes = (ctypes.c_ulong, ctypes.py_object)
    set_async.restype = ctypes.c_int
    set_async(ident, exc)


@contextlib.contextmanager
def reader_call(label: str, args=(), kwargs=None):
    """Around one (outermost) call of the reader's function: after :func:`call_time_limit` seconds the call is
    stopped with an ExerciseError naming it; in a check's child the parent also sees the call running, and ends
    the child if the call does not stop (a loop in compiled code, or one that catches BaseException)."""
    limit = call_time_limit()
    description = describe(args, kwargs)
    ident = threading.get_ident()
    lock = threading.Lock()
    state = {"active": True, "fired": False}

    def fire():
        with lock:
            if state["active"]:
                state["fired"] = True
                _set_async(ident, CallTimeout)

    modules_before = set(sys.modules) if _CHILD is not None else None
    if _CHILD is not None:
        data = description.encode("utf-8", "replace")[:_DESCRIPTION_SIZE]
        _CHILD[_DESCRIPTION_AT:_DESCRIPTION_AT + _DESCRIPTION_SIZE] = data.ljust(_DESCRIPTION_SIZE, b"\0")
        struct.pack_into("<d", _CHILD, 0, time.monotonic())
    timer = threading.Timer(limit, fire)
    timer.daemon = True
    timer.start()
    timed_out = False
    try:
        yield
    except CallTimeout:
        timed_out = True
    finally:
        fired = _stop(lock, state, timer, delivered=timed_out)
        if modules_before is not None:
            _READERS_IMPORTS.update(set(sys.modules) - modules_before)
    if timed_out or fired:
        raise ExerciseError(_timeout_message(label, limit, description))


def _stop(lock, state, timer, delivered: bool) -> bool:
    """End a call's watch; whether its time ran out. A CallTimeout that was raised but has not arrived yet (the
    limit reached as the call returned) is let arrive here, and taken for what it is. (Never taken back with
    PyThreadState_SetAsyncExc(id, NULL): in CPython 3.11 that leaves the interpreter's "exception pending" flag
    set for good, and code run under sys.settrace, as the checks that count lines run the reader's, then spins for
    ever; tests/exercises/test_exercise_isolation.py holds it.)"""
    for _ in range(100):
        try:
            with lock:
                state["active"] = False
                fired = state["fired"]
            timer.cancel()
            if fired and not delivered:
                for _ in range(200_000):  # each turn a backward jump, where a pending exception is raised
                    pass
            break
        except CallTimeout:
            delivered = True
    else:  # pragma: no cover - a hundred CallTimeouts for one call cannot come
        fired = True
    if _CHILD is not None:
        struct.pack_into("<d", _CHILD, 0, 0.0)
    return fired


# ------------------------------------------------------------------------------------------- one check


def run_check(body, *, label: str, suffix: str = "") -> None:
    """Run ``body()`` (a check, raising ExerciseError or returning after printing ``Correct: ...``) in a child
    process (the module docstring), or here when :func:`in_process_reason` says so."""
    if in_process_reason() is None and _run_in_child(body, label, suffix):
        return
    try:
        body()
    except SystemExit as exc:
        raise ExerciseError(f"your {label} raised SystemExit ({exc}): a function that is checked must return, "
                            "not end the program" + suffix) from None


def _child_main(body, label: str, suffix: str, read_fd: int, write_fd: int, shared: mmap.mmap) -> None:
    global _CHILD
    status = 0
    try:
        os.close(read_fd)
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)  # one process group: the processes the reader's code starts end with the check
        _CHILD = shared
        modules_before = set(sys.modules)
        _after_fork()
        out, err = io.StringIO(), io.StringIO()
        sys.stdout, sys.stderr = out, err
        try:
            body()
            result = {"ok": True}
        except ExerciseError as exc:
            result = {"ok": False, "integrity": isinstance(exc, IntegrityError), "message": _text(exc)}
        except SystemExit as exc:
            result = {"ok": False, "message": f"your {label} raised SystemExit ({exc}): a function that is checked "
                                              "must return, not end the program" + suffix}
        except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt, GeneratorExit: reported, never a crash
            result = {"ok": False, "message": f"your {label} raised {type(exc).__name__}: {exc}" + suffix}
        result["stdout"], result["stderr"] = out.getvalue(), err.getvalue()
        result["imported"] = _check_imports(modules_before)
        payload = pickle.dumps(result)
        view = memoryview(struct.pack("<Q", len(payload)) + payload)  # its length first: the parent knows the end
        while view:
            view = view[os.write(write_fd, view):]
    except BaseException:  # noqa: BLE001 - whatever happens, the child ends here (never in the parent's code)
        status = 70
    finally:
        os._exit(status)


def _after_fork() -> None:
    """The child of a multi-threaded process: its thread pools are gone. torch's OpenMP pool would hang the first
    parallel operation (GNU OpenMP does not survive a fork), so torch runs on one thread here; a forkserver the
    notebook started belongs to it, so the reader's code gets one of its own (started with the guard's
    environment); faulthandler (pytest turns it on) would print the check's stack on a crash the message
    already names."""
    torch = sys.modules.get("torch")
    if torch is not None:
        with contextlib.suppress(Exception):
            torch.set_num_threads(1)
    faulthandler = sys.modules.get("faulthandler")
    if faulthandler is not None:  # a crash of the reader's code is reported in words, not as the check's stack
        with contextlib.suppress(Exception):
            faulthandler.disable()
    forkserver = sys.modules.get("multiprocessing.forkserver")
    if forkserver is not None:
        with contextlib.suppress(Exception):
            fresh = forkserver.ForkServer()
            forkserver._forkserver = fresh
            forkserver.ensure_running = fresh.ensure_running
            forkserver.get_inherited_fds = fresh.get_inherited_fds
            forkserver.connect_to_new_process = fresh.connect_to_new_process
            forkserver.set_forkserver_preload = fresh.set_forkserver_preload


def _library_roots() -> tuple[str, ...]:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # lightning_edu
    return tuple(os.path.realpath(p) + os.sep for p in {here, sys.prefix, sys.base_prefix, sys.exec_prefix})


def _check_imports(before: set) -> list[str]:
    """The modules the check imported in the child (numpy.ma, the first time a reference needs it), not the reader's
    function: the library's and the package's own, for the parent to import once, so that the next check's child
    finds them imported (each child importing them again took most of a check's time)."""
    roots = _library_roots()
    names = []
    for name in set(sys.modules) - before - _READERS_IMPORTS:
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if module is None or not path or name.startswith(("__main__", "__mp_main__", "_lightning_edu")):
            continue
        if os.path.realpath(path).startswith(roots):
            names.append(name)
    return sorted(names, key=lambda n: (n.count("."), n))


def _import_here(names) -> None:
    """Import in this process what the check's child imported (:func:`_check_imports`); what fails is skipped."""
    import importlib

    for name in names or ():
        if name not in sys.modules:
            with contextlib.suppress(Exception):
                importlib.import_module(name)


def _text(exc: BaseException) -> str:
    return str(exc.args[0]) if exc.args else str(exc)


def _run_in_child(body, label: str, suffix: str) -> bool:
    """The check in a child process; False when no child could be started (then nothing has run)."""
    call_limit, check_limit = call_time_limit(), check_time_limit()
    shared = mmap.mmap(-1, _SHARED)
    read_fd, write_fd = os.pipe()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    # The objects alive now are the child's to read, not to collect: frozen, its garbage collector leaves them
    # alone, and does not copy the notebook's memory page by page by touching them (most of a check's time else).
    freeze = gc.get_freeze_count() == 0  # objects someone else froze stay as they are: no unfreeze of theirs
    if freeze:
        gc.freeze()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Python 3.12's DeprecationWarning on a fork of a multi-threaded process
            pid = os.fork()
    except OSError:  # no process to be had (a limit on processes, or memory): the check runs here, as before
        if freeze:
            gc.unfreeze()
        os.close(read_fd)
        os.close(write_fd)
        shared.close()
        return False
    if pid == 0:  # pragma: no cover - the child; coverage does not follow it
        _child_main(body, label, suffix, read_fd, write_fd, shared)
    if freeze:
        gc.unfreeze()
    os.close(write_fd)
    with contextlib.suppress(OSError):
        os.setpgid(pid, pid)  # the child does the same: whichever runs first, the group exists before a kill
    reaped, outcome = None, None
    try:
        data, outcome = _watch(pid, read_fd, shared, call_limit, check_limit)
        description = bytes(shared[_DESCRIPTION_AT:_DESCRIPTION_AT + _DESCRIPTION_SIZE]).rstrip(b"\0").decode(
            "utf-8", "replace")
        running = struct.unpack_from("<d", shared, 0)[0] > 0
    finally:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)  # the child if it still runs, and what the reader's code left behind
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        os.close(read_fd)
        shared.close()
        if outcome == "result":
            _reap_later(pid)  # the child is ending (a few ms for a large process): reaped at the next check
        else:
            with contextlib.suppress(ChildProcessError):
                reaped = os.waitpid(pid, 0)[1]
    if outcome == "call":
        raise ExerciseError(_timeout_message(label, call_limit, description) + suffix)
    if outcome == "check":
        raise ExerciseError(f"the check of your {label} did not finish within {check_limit:g} s"
                            + (f" (its last call: {description})" if description else "")
                            + ": an endless loop? The check stops after that long" + suffix)
    try:
        result = pickle.loads(data[8:]) if outcome == "result" else None
    except Exception:  # noqa: BLE001 - a result that does not read: as if there were none
        result = None
    if not isinstance(result, dict):  # nothing, or half a result: the process ended before the check did
        raise ExerciseError(_death_message(label, reaped, description if running else "") + suffix)
    _relay(result.get("stdout", ""), sys.stdout)
    _relay(result.get("stderr", ""), sys.stderr)
    _import_here(result.get("imported"))
    if not result.get("ok"):
        raise (IntegrityError if result.get("integrity") else ExerciseError)(result.get("message", ""))
    return True


_UNREAPED: list[int] = []


def _reap_later(pid: int) -> None:
    """Leave ``pid`` (killed, ending) to be reaped by the next check, or when this process exits."""
    if not _UNREAPED:
        atexit.register(_reap, True)
    _UNREAPED.append(pid)
    _reap()


def _reap(block: bool = False) -> None:
    for pid in list(_UNREAPED):
        try:
            done = os.waitpid(pid, 0 if block else os.WNOHANG)[0]
        except ChildProcessError:  # reaped by someone else (a SIGCHLD handler, os.wait())
            done = pid
        if done:
            _UNREAPED.remove(pid)


def _watch(pid: int, read_fd: int, shared: mmap.mmap, call_limit: float, check_limit: float):
    """Read the child's result until it is whole, or the child ends, or a call or the check runs past its limit:
    (the bytes read, "result", "ended", "call" or "check")."""
    data = bytearray()
    start = time.monotonic()
    eof = False
    poller = select.poll()  # not select.select: it refuses a descriptor numbered 1024 or more
    poller.register(read_fd, select.POLLIN | select.POLLHUP)
    while True:
        if not eof:
            if poller.poll(50):
                chunk = os.read(read_fd, 1 << 20)
                if chunk:
                    data += chunk
                    if len(data) >= 8 and len(data) >= 8 + struct.unpack_from("<Q", data)[0]:
                        return bytes(data), "result"
                    continue
                eof = True
        else:
            time.sleep(0.005)
        try:
            gone = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:  # reaped already (a SIGCHLD set to be ignored)
            gone = True
        if gone:
            if not eof:  # the child is gone; read what it wrote (a process it started may hold the pipe open)
                os.set_blocking(read_fd, False)
                with contextlib.suppress(BlockingIOError):
                    while chunk := os.read(read_fd, 1 << 20):
                        data += chunk
            whole = len(data) >= 8 and len(data) >= 8 + struct.unpack_from("<Q", data)[0]
            return bytes(data), "result" if whole else "ended"
        now = time.monotonic()
        started = struct.unpack_from("<d", shared, 0)[0]
        if started and now - started > call_limit + _GRACE:
            return bytes(data), "call"
        if now - start > check_limit:
            return bytes(data), "check"


def _death_message(label: str, status, description: str) -> str:
    code = os.waitstatus_to_exitcode(status) if status is not None else None
    if code is None:
        what = "ended the process running the check"
    elif code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        if -code == signal.SIGKILL:
            what = f"was killed ({name}), most often by the system when the machine runs out of memory"
        else:
            what = f"crashed ({name}: a fault in compiled code, such as an out-of-bounds access through a pointer)"
    else:
        what = (f"ended the process running the check, with exit code {code} (os._exit, or exit() in a process of "
                "its own)")
    during = f", during its call with {description}" if description else ""
    return (f"your function {label} {what}{during}; the check could not finish. The check runs in a process of its "
            "own, so the notebook and the other exercises go on")


def _relay(text: str, stream) -> None:
    if not text:
        return
    if len(text) > _OUTPUT_LIMIT:
        text = text[:_OUTPUT_LIMIT] + f"\n[... {len(text) - _OUTPUT_LIMIT} more characters of output left out]\n"
    with contextlib.suppress(Exception):
        stream.write(text)
        stream.flush()
