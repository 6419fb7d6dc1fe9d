"""The reader writes the algorithm: a check rejects an answer that calls the package's own implementation.

Two layers, both run by every check (:func:`lightning_edu.exercises._core.exercise`):

* :func:`scan` reads the reader's function before it runs: the global names and attributes its code refers to
  (and those of the reader's helpers it calls), resolved against the notebook's namespace. In a Triton kernel
  any name that resolves to an implementation in ``lightning_edu`` fails the check, with a message naming it;
  in a Python function only what :func:`guarded` cannot switch off (a class, a wrapped function) does.
* :func:`guarded` runs the reader's function with every implementation function of ``lightning_edu``
  switched off: the code object of each is swapped for a trap that fails the check when the call comes from the
  reader's code, and runs the original when it comes from a function the exercise allows (an allowed function
  may use the package internally). This catches calls the scan cannot see (``getattr``, imports inside the
  function, a package function passed to numpy), in every thread: a call from a thread the reader's code started
  (``threading``, ``concurrent.futures``) fails too, as does a call from a process it forks (the trap writes
  into the call's report folder, read when the function returns). A fresh Python it starts (``subprocess``,
  ``multiprocessing`` with "spawn" or "forkserver") finds a ``sitecustomize`` first on its ``PYTHONPATH`` that
  switches the implementations off there too (:mod:`._sentinels`). A module of the package imported during the
  call is switched off as it is imported. Each call has a time limit (:func:`._isolation.reader_call`).

Neither catches a copy of the package's code pasted into the answer; INSTRUCTORS.md says so, and what else
escapes (a process started with an environment of its own, code run while a module is being imported).
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
import tempfile
import threading
import types

from . import _isolation, _sentinels
from ._errors import ExerciseError, IntegrityError

__all__ = ["IntegrityError", "scan", "guarded", "resolve"]

_PACKAGE = _sentinels.PACKAGE
# Modules a reader may call freely (comparisons, argument checks, the notebook helpers, measurement tools, the
# course tools, the checking machinery): _sentinels.SAFE_MODULES. Everything else in lightning_edu is an
# implementation of something.
_SAFE_MODULES = _sentinels.SAFE_MODULES
_SAFE_PREFIXES = _sentinels.SAFE_PREFIXES
# Imported before a guarded call so that their functions are switched off even if the notebook has not
# imported them yet (a reader's function may import them itself).
_IMPLEMENTATION_MODULES = (
    "lightning_edu.api",
    "lightning_edu.numpy_reference",
    "lightning_edu.numpy_blockwise",
    "lightning_edu.numpy_la3",
    "lightning_edu.torch_chunked",
    "lightning_edu.packed",
    "lightning_edu.errata",
    "lightning_edu.feature_maps",
    "lightning_edu.feature_core",
    "lightning_edu.costs",
    "lightning_edu.distributed",
)


def _error(message: str) -> IntegrityError:
    return IntegrityError(message)


# ------------------------------------------------------------------------------------------- what is what


_is_safe_module = _sentinels.is_safe_module
_is_implementation_module = _sentinels.is_implementation_module


def _unwrap_kernel(obj):
    """The Python function inside a Triton ``@triton.jit`` (or autotuned) kernel, else ``obj``."""
    seen = 0
    while not isinstance(obj, types.FunctionType) and hasattr(obj, "fn") and seen < 4:
        obj = obj.fn
        seen += 1
    return obj


def _defining_module(obj) -> str | None:
    inner = _unwrap_kernel(obj)
    module = getattr(inner, "__module__", None)
    return module if isinstance(module, str) else None


def is_implementation(obj) -> bool:
    """A function, kernel or class defined in an implementation module of lightning_edu."""
    if isinstance(obj, types.ModuleType):
        return False
    inner = _unwrap_kernel(obj)
    if not (isinstance(inner, (types.FunctionType, type)) or hasattr(obj, "fn")):
        return False
    return _is_implementation_module(_defining_module(obj))


def implementation_name(obj) -> str:
    """The name a reader knows: ``lightning_edu.lightning_attention`` for what the package re-exports, else the
    module path, ``lightning_edu.numpy_reference.causal_linear_recurrent``."""
    import lightning_edu

    inner = _unwrap_kernel(obj)
    name = getattr(inner, "__name__", repr(obj))
    if getattr(lightning_edu, name, None) is obj:
        return f"{_PACKAGE}.{name}"
    return f"{_defining_module(obj)}.{getattr(inner, '__qualname__', name)}"


def resolve(path: str):
    """The object named by a dotted path such as ``lightning_edu.numpy_reference.elu_plus_one``."""
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def _is_reader_function(obj) -> bool:
    inner = _unwrap_kernel(obj)
    if not isinstance(inner, types.FunctionType):
        return False
    module = inner.__module__ or ""
    return not (module == _PACKAGE or module.startswith(_PACKAGE + ".")) and not _is_library_file(inner.__code__.co_filename)


def _is_library_file(filename: str) -> bool:
    return ("site-packages" in filename or "dist-packages" in filename
            or filename.startswith((sys.prefix + "/lib", sys.base_prefix + "/lib")))


# ------------------------------------------------------------------------------------------- the scan


def _codes(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _trappable(obj) -> bool:
    """A plain function without a closure: :func:`guarded` switches it off while the reader's code runs."""
    return isinstance(obj, types.FunctionType) and not obj.__closure__ and not obj.__code__.co_freevars


def scan(fn, *, allowed=(), label: str | None = None, kernel: bool = False) -> None:
    """Raise if ``fn`` (the reader's function or kernel) refers to a package implementation not in ``allowed``.

    ``allowed`` holds objects (functions the exercise permits). Helpers the reader wrote are followed. For a
    Python function only what :func:`guarded` cannot switch off is reported here (a class, a kernel, a wrapped
    function): a plain package function mentioned in a branch that never runs is no offence, and one that runs
    is caught when it is called. For a Triton kernel (``kernel=True``) every reference counts.
    """
    allowed_ids = {id(_unwrap_kernel(a)) for a in allowed} | {id(a) for a in allowed}
    label = label or getattr(_unwrap_kernel(fn), "__name__", "function")
    visited: set[int] = set()

    def forbidden(obj) -> bool:
        if id(obj) in allowed_ids or id(_unwrap_kernel(obj)) in allowed_ids or not is_implementation(obj):
            return False
        return kernel or not _trappable(obj)

    def fail(obj, via: str | None = None):
        via = f" (through {via})" if via else ""
        raise _error(f"your function {label} calls {implementation_name(obj)}{via}: write the algorithm yourself "
                     "(the check runs your code with the package's implementations switched off)")

    if is_implementation(fn) and id(fn) not in allowed_ids:
        raise _error(f"your function {label} is {implementation_name(fn)} itself: write the algorithm yourself")

    def visit(func, via: str | None):
        func = _unwrap_kernel(func)
        if not isinstance(func, types.FunctionType) or id(func) in visited:
            return
        visited.add(id(func))
        names = set()
        for code in _codes(func.__code__):
            names.update(code.co_names)
        found = []
        for name in names:
            if name in func.__globals__:
                found.append(func.__globals__[name])
            elif name.startswith(_PACKAGE):  # `import lightning_edu.x` inside the function
                found.append(sys.modules.get(name) or sys.modules.get(name.split(".")[0]))
        for cell in func.__closure__ or ():
            try:
                found.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
        modules_seen: set[int] = set()
        while found:
            obj = found.pop()
            if obj is None:
                continue
            if isinstance(obj, types.ModuleType):
                if id(obj) in modules_seen or not (obj.__name__ == _PACKAGE or obj.__name__.startswith(_PACKAGE + ".")):
                    continue
                modules_seen.add(id(obj))
                found.extend(getattr(obj, name) for name in names if hasattr(obj, name) and not name.startswith("__"))
            elif forbidden(obj):
                fail(obj, via)
            elif _is_reader_function(obj) and obj is not func:
                visit(obj, via or getattr(_unwrap_kernel(obj), "__name__", None))

    visit(fn, None)


# ------------------------------------------------------------------------------------------- the trap


def _trap_template(*args, **kwargs):
    return __import__("lightning_edu.exercises._integrity", fromlist=["_trapped"])._trapped(args, kwargs)


class _Record:
    __slots__ = ("function", "original", "trap")

    def __init__(self, function, original, trap):
        self.function, self.original, self.trap = function, original, trap


_RECORDS: dict[int, _Record] = {}  # id(trap code) -> record; the records keep the code objects alive
_BY_FUNCTION: dict[int, _Record] = {}
# What the guarded call now running allows, and what it found. "thread": the thread the reader's function runs
# in; "threads_before": the threads alive when the call began (in the notebook's own process, those are not the
# reader's); "pid": the process of the call (a process forked from it reports through "report", a folder).
_STATE = {"depth": 0, "allowed": frozenset(), "strict": frozenset(), "label": "", "violation": None,
          "thread": None, "threads_before": frozenset(), "pid": None, "report": None}


def _record(function) -> _Record | None:
    rec = _BY_FUNCTION.get(id(function))
    if rec is not None and rec.function is function:
        return rec
    code = function.__code__
    if code.co_freevars or function.__closure__:
        return None  # a closure cannot take a code object without free variables
    if id(code) in _RECORDS:  # already a trap: installed by a call still running
        return None
    trap = _trap_template.__code__.replace(co_name=code.co_name, co_qualname=function.__qualname__)
    rec = _Record(function, code, trap)
    _BY_FUNCTION[id(function)] = rec
    _RECORDS[id(trap)] = rec
    return rec


_FUNCTIONS_CACHE: dict = {"modules": -1, "functions": []}


def _implementation_functions() -> list:
    """Every plain function defined in an implementation module of lightning_edu that is imported now."""
    for name in _IMPLEMENTATION_MODULES:
        if name not in sys.modules:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - a module that cannot be imported here cannot be called either
                pass
    if _FUNCTIONS_CACHE["modules"] != len(sys.modules):
        functions = []
        for name, module in list(sys.modules.items()):
            if module is None or not _is_implementation_module(name):
                continue
            functions.extend(_module_functions(module, name))
        _FUNCTIONS_CACHE.update(modules=len(sys.modules), functions=functions)
    return _FUNCTIONS_CACHE["functions"]


def prepare() -> None:
    """Import the implementation modules and list their functions here, in the notebook's process, before a check
    forks its child: the child then finds both done (done in each child, they took most of a check's time)."""
    _implementation_functions()


def _module_functions(module, name: str) -> list:
    return [obj for obj in list(vars(module).values())
            if isinstance(obj, types.FunctionType) and obj.__module__ == name and obj.__code__ is not None]


def _call_original(rec: _Record, args, kwargs):
    f = rec.function
    original = types.FunctionType(rec.original, f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    original.__kwdefaults__ = f.__kwdefaults__
    original.__dict__.update(f.__dict__)
    return original(*args, **kwargs)


def _trapped(args, kwargs):
    trap_frame = sys._getframe(1)
    rec = _RECORDS.get(id(trap_frame.f_code))
    if rec is None:  # pragma: no cover - only trap code objects call this
        raise RuntimeError("lightning_edu: an exercise trap was called from outside a trap")
    if not _STATE["depth"]:  # pragma: no cover - traps are removed when the last guard exits
        return _call_original(rec, args, kwargs)
    where = ""
    if id(rec.function) not in _STATE["strict"]:
        frame = trap_frame.f_back
        while frame is not None:
            code = frame.f_code
            if code is _guard_code():
                break  # reached the reader's call without passing an allowed function: the reader called it
            if id(code) in _STATE["allowed"] or code.co_filename.startswith("<frozen importlib"):
                return _call_original(rec, args, kwargs)  # inside an allowed function, or a module's import
            frame = frame.f_back
        else:
            # Not below the reader's call in this thread: another thread, or a process forked from one.
            if os.getpid() == _STATE["pid"]:
                ident = threading.get_ident()
                if ident == _STATE["thread"] or (ident in _STATE["threads_before"] and not _isolation.in_child()):
                    return _call_original(rec, args, kwargs)  # not the reader's thread: this process's own
                where = " from a thread it started"
    if os.getpid() != _STATE["pid"]:
        where = " in a process it started"
    message = (f"your function {_STATE['label']} calls {implementation_name(rec.function)}{where}: write the "
               "algorithm yourself (the check runs your code with the package's implementations switched off"
               + (", in the threads and processes it starts too)" if where else ")"))
    _STATE["violation"] = _STATE["violation"] or message
    if os.getpid() != _STATE["pid"]:
        _sentinels._CONFIG["report"] = _STATE["report"]
        _sentinels._report(message)
    raise _error(message)


def _guard_code():
    return _run_guarded.__code__


def _run_guarded(fn, args, kwargs):
    return fn(*args, **kwargs)


def _reported(folder: str | None) -> str | None:
    """The first message a process started by the reader's code wrote into the call's report folder."""
    if not folder:
        return None
    try:
        names = sorted(n for n in os.listdir(folder) if n.startswith("violation-") and n.endswith(".txt"))
        for name in names:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                text = f.read().strip()
            if text:
                return text
    except OSError:
        return None
    return None


class _Processes:
    """For one call of the reader's function: a folder with a ``sitecustomize.py`` put first on ``PYTHONPATH``
    (a fresh Python started from the call switches the implementations off, :mod:`._sentinels`) and the report
    folder the traps of other processes write into; the environment is restored when the call ends."""

    def __init__(self, label: str, allowed_fns, strict_fns):
        self.saved = {}
        try:
            self.folder = tempfile.mkdtemp(prefix="lightning_edu_check_")
            self.report = os.path.join(self.folder, "reports")
            os.mkdir(self.report)
            with open(os.path.join(self.folder, "sitecustomize.py"), "w", encoding="utf-8") as f:
                f.write(_sentinels.sitecustomize_source())
        except OSError:  # no temporary folder to be had: the processes it starts go unwatched, the rest holds
            self.folder = self.report = None
            return
        config = {"report": self.report, "label": label,
                  "allowed": sorted(_sentinels.qualified_name(a) for a in allowed_fns),
                  "strict": sorted(_sentinels.qualified_name(s) for s in strict_fns)}
        self.saved = {name: os.environ.get(name) for name in ("PYTHONPATH", _sentinels.ENV)}
        path = self.saved["PYTHONPATH"]
        os.environ["PYTHONPATH"] = self.folder + (os.pathsep + path if path else "")
        os.environ[_sentinels.ENV] = json.dumps(config)

    def close(self) -> None:
        for name, value in self.saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)


def guarded(fn, *, allowed=(), strict=(), substitutes=None, label: str | None = None, on_error=None):
    """``fn`` wrapped so that each call runs with lightning_edu's implementations switched off.

    ``allowed``: functions the reader may call (they run the package internally as usual); ``strict``: functions
    that fail even when reached through an allowed one; ``substitutes``: {name: function} put into the reader's
    namespace for the call (the book's version of an earlier exercise's answer, so a mistake there is not
    counted twice). ``on_error(exc)`` is called with any exception the reader's code raises: it may mark it, or
    return an exception to raise in its place. Each outermost call has a time limit
    (:func:`._isolation.reader_call`).
    """
    label = label or getattr(fn, "__name__", "function")
    allowed_codes = frozenset(id(getattr(_unwrap_kernel(a), "__code__", None)) for a in allowed)
    substitutes = dict(substitutes or {})
    allowed_codes |= frozenset(id(s.__code__) for s in substitutes.values())
    allowed_fns = {id(a) for a in allowed} | {id(s) for s in substitutes.values()}
    strict_ids = frozenset(id(s) for s in strict)
    allowed_plain = [_unwrap_kernel(a) for a in allowed if isinstance(_unwrap_kernel(a), types.FunctionType)]
    strict_plain = [s for s in strict if isinstance(s, types.FunctionType)]

    def trappable(function) -> bool:
        return not (id(function) in allowed_fns and id(function) not in strict_ids)

    def call(*args, **kwargs):
        outer = _STATE["depth"] == 0
        saved_state = dict(_STATE)
        records = []
        replaced = {}
        processes = finder = None
        if outer:
            seen = set()
            for function in _implementation_functions():
                if id(function) in seen or not trappable(function):
                    continue
                seen.add(id(function))
                rec = _record(function)
                if rec is not None:
                    records.append(rec)
        namespace = getattr(fn, "__globals__", None)
        if namespace is not None:
            for name, substitute in substitutes.items():
                current = namespace.get(name)
                if current is not None and _is_reader_function(current) and current is not fn:
                    replaced[name] = current
                    namespace[name] = substitute
        state = dict(depth=_STATE["depth"] + 1, allowed=allowed_codes, strict=strict_ids, label=label,
                     violation=None)
        if outer:
            processes = _Processes(label, allowed_plain, strict_plain)
            state.update(thread=threading.get_ident(), pid=os.getpid(), report=processes.report,
                         threads_before=frozenset(t.ident for t in threading.enumerate()))

            def after_import(module):  # a module of the package imported during the call: switched off too
                name = getattr(module, "__name__", None)
                if not _is_implementation_module(name):
                    return
                for function in _module_functions(module, name):
                    rec = _record(function) if trappable(function) else None
                    if rec is not None:
                        records.append(rec)
                        function.__code__ = rec.trap

            finder = _sentinels.PostImportFinder(after_import)
        _STATE.update(state)
        try:
            for rec in records:
                rec.function.__code__ = rec.trap
            if finder is not None:
                sys.meta_path.insert(0, finder)
            try:
                if outer:
                    with _isolation.reader_call(label, args, kwargs):
                        out = _run_guarded(fn, args, kwargs)
                else:
                    out = _run_guarded(fn, args, kwargs)
            except BaseException as exc:
                violation = _STATE["violation"] or (_reported(processes.report) if processes else None)
                if violation and not isinstance(exc, IntegrityError):
                    raise _error(violation) from exc
                if on_error is not None and isinstance(exc, Exception) and not isinstance(exc, ExerciseError):
                    replacement = on_error(exc)
                    if replacement is not None:
                        raise replacement from exc
                raise
            violation = _STATE["violation"] or (_reported(processes.report) if processes else None)
            if violation:  # the reader's code caught the failure and went on, or met it in another process
                raise _error(violation)
            return out
        finally:
            if finder is not None:
                try:
                    sys.meta_path.remove(finder)
                except ValueError:
                    pass
            for rec in records:
                rec.function.__code__ = rec.original
            for name, original in replaced.items():
                namespace[name] = original
            if processes is not None:
                processes.close()
            _STATE.clear()
            _STATE.update(saved_state)

    call.__name__ = label
    call.__wrapped__ = fn
    return call
