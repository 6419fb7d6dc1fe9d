"""What is an implementation of lightning_edu, and the sentinels that stand in for it in a process the reader's
code starts while a check runs.

This module imports nothing but the standard library, and nothing of the package: a fresh interpreter (a
``subprocess`` running ``python -c ...``, a ``multiprocessing`` process started with "spawn" or "forkserver")
loads it by its path from a ``sitecustomize.py`` that :mod:`._integrity` writes into a folder of its own and
puts first on ``PYTHONPATH`` for the duration of each call of the reader's function. There, :func:`install`
reads the check's settings from the environment (:data:`ENV`) and adds an import hook: every plain function of
an implementation module of lightning_edu imported in that process is replaced by a sentinel that raises, and
writes the message into the check's report folder, where the check finds it when the reader's function returns.
A function the exercise allows runs as usual, and so does what it calls; so do calls made while a module is
being imported (the package's own import-time code).

:mod:`._integrity` uses the same lists (:func:`is_implementation_module`) and the same import hook
(:class:`PostImportFinder`) in the checking process itself.

Not caught: a process started with an environment of its own (``env={}``), or ``python -I``, ``-E`` or ``-S``,
which skip ``PYTHONPATH`` or ``sitecustomize``; INSTRUCTORS.md says so.
"""

from __future__ import annotations

import json
import os
import sys
import types

ENV = "LIGHTNING_EDU_EXERCISE_GUARD"
NAME = "_lightning_edu_exercise_sentinels"  # the name this module has in sys.modules of a fresh interpreter
PACKAGE = "lightning_edu"
# Modules a reader may call freely: comparisons, argument checks, the notebook helpers, measurement tools, the
# course tools and the checking machinery itself. Everything else in lightning_edu is an implementation.
SAFE_MODULES = (
    "lightning_edu",
    "lightning_edu.checks",
    "lightning_edu.validation",
    "lightning_edu.book",
    "lightning_edu.measure",
    "lightning_edu.environment",
    "lightning_edu.assignments",
    "lightning_edu.exercises",
    "lightning_edu.exercises._core",
    "lightning_edu.exercises._errors",
    "lightning_edu.exercises._integrity",
    "lightning_edu.exercises._isolation",
    "lightning_edu.exercises._sentinels",
)
SAFE_PREFIXES = ("lightning_edu.book.",)


def in_package(name: str | None) -> bool:
    return bool(name) and (name == PACKAGE or name.startswith(PACKAGE + "."))


def is_safe_module(name: str) -> bool:
    return name in SAFE_MODULES or name.startswith(SAFE_PREFIXES) or not in_package(name)


def is_implementation_module(name: str | None) -> bool:
    return bool(name) and name.startswith(PACKAGE + ".") and not is_safe_module(name)


def qualified_name(function) -> str:
    """``module.qualname`` of a function: how a function is named across processes."""
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', '?')}"


def in_import(frame) -> bool:
    """Whether ``frame`` or a frame below it runs an import (a module's top-level code)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


# ------------------------------------------------------------------------------------------- the import hook


class _Loader:
    """A module's own loader, with ``after(module)`` called once the module has run."""

    def __init__(self, loader, after):
        self._loader, self._after = loader, after

    def __getattr__(self, name):  # get_resource_reader, is_package, ...: the real loader's
        return getattr(self._loader, name)

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._after(module)


class PostImportFinder:
    """A ``sys.meta_path`` entry that lets the other finders find each module of lightning_edu and calls
    ``after(module)`` once that module has been imported."""

    def __init__(self, after):
        self.after = after

    def find_spec(self, fullname, path=None, target=None):
        if not in_package(fullname):
            return None
        for finder in sys.meta_path:
            if finder is self or isinstance(finder, PostImportFinder) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, self.after)
                return spec
        return None

    def invalidate_caches(self):
        pass


# ------------------------------------------------------------------------------------------- a fresh process


def _trap_template(*args, **kwargs):
    return __import__("_lightning_edu_exercise_sentinels")._hit(args, kwargs)


_ORIGINALS: dict[int, tuple] = {}  # id(trap code) -> (function, original code); they keep the codes alive
_CONFIG: dict = {}


def _report(message: str) -> None:
    folder = _CONFIG.get("report")
    if not folder:
        return
    try:
        path = os.path.join(folder, f"violation-{os.getpid()}-{len(os.listdir(folder))}.txt")
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.write(message)
        os.replace(path + ".tmp", path)
    except OSError:  # the check's folder is gone (the check is over): nothing left to tell
        pass


def _display_name(function) -> str:
    package = sys.modules.get(PACKAGE)
    if package is not None and getattr(package, function.__name__, None) is function:
        return f"{PACKAGE}.{function.__name__}"
    return qualified_name(function)


def _hit(args, kwargs):
    frame = sys._getframe(1)
    function, original = _ORIGINALS[id(frame.f_code)]
    run = None
    if qualified_name(function) not in _CONFIG.get("strict", ()):
        allowed = set(_CONFIG.get("allowed", ()))
        caller = frame.f_back
        if in_import(caller):
            run = original
        while run is None and caller is not None:
            name = f"{caller.f_globals.get('__name__')}.{caller.f_code.co_qualname}"
            if name in allowed:
                run = original
            caller = caller.f_back
    if run is not None:
        call = types.FunctionType(run, function.__globals__, function.__name__, function.__defaults__,
                                  function.__closure__)
        call.__kwdefaults__ = function.__kwdefaults__
        return call(*args, **kwargs)
    message = (f"your function {_CONFIG.get('label', 'function')} calls {_display_name(function)} in a process it "
               "started: write the algorithm yourself (the check runs your code with the package's "
               "implementations switched off, in the threads and processes it starts too)")
    _report(message)
    raise AssertionError(message)


def poison(module) -> None:
    """Replace every plain function of ``module`` (an implementation module) by a sentinel."""
    name = getattr(module, "__name__", None)
    if not is_implementation_module(name):
        return
    allowed = set(_CONFIG.get("allowed", ())) - set(_CONFIG.get("strict", ()))
    for obj in list(vars(module).values()):
        if (not isinstance(obj, types.FunctionType) or obj.__module__ != name or obj.__closure__
                or obj.__code__.co_freevars or qualified_name(obj) in allowed):
            continue
        if id(obj.__code__) in _ORIGINALS:
            continue
        trap = _trap_template.__code__.replace(co_name=obj.__code__.co_name, co_qualname=obj.__qualname__)
        _ORIGINALS[id(trap)] = (obj, obj.__code__)
        obj.__code__ = trap


def install() -> bool:
    """In a fresh interpreter started while a check ran: switch off the package's implementations (the module
    docstring). Returns whether the environment asked for it."""
    try:
        config = json.loads(os.environ.get(ENV) or "null")
    except ValueError:
        return False
    if not isinstance(config, dict):
        return False
    _CONFIG.clear()
    _CONFIG.update(config)
    sys.modules[NAME] = sys.modules[__name__]  # the traps find this module by that name
    for loaded in list(sys.modules.values()):
        if loaded is not None:
            poison(loaded)
    sys.meta_path.insert(0, PostImportFinder(poison))
    return True


SITECUSTOMIZE = '''\
# Written by lightning_edu.exercises._integrity while an exercise check runs the reader's function: a Python
# started from that function switches the package's implementations off (lightning_edu/exercises/_sentinels.py).
def _lightning_edu_guard():
    import importlib.machinery, importlib.util, os, sys
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location({name!r}, {path!r})
    module = importlib.util.module_from_spec(spec)
    sys.modules[{name!r}] = module
    spec.loader.exec_module(module)
    module.install()
    # the sitecustomize this one hides, if the installation has one
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


_lightning_edu_guard()
del _lightning_edu_guard
'''


def sitecustomize_source() -> str:
    return SITECUSTOMIZE.format(name=NAME, path=os.path.abspath(__file__))
