"""A check runs in a process of its own, with the package's implementations switched off in every thread and in
every process the reader's code starts, and a time limit on each call of the reader's function
(lightning_edu/exercises/_isolation.py, _integrity.py, _sentinels.py):

* a call of the package from a thread (threading.Thread, ThreadPoolExecutor), from a process (multiprocessing
  with fork or spawn, ProcessPoolExecutor, os.fork, a subprocess running python -c), through importlib or getattr,
  or from a module imported during the call, is refused with a message naming it; an allowed helper still runs,
  from a thread too;
* a crash (os._exit, a segmentation fault, SIGKILL) fails that check with a message, and the next check runs;
* a call that never returns is stopped after the limit, with a message naming the function, also when it catches
  the exception meant to stop it; the processes it started end with the check;
* with the child process off (LIGHTNING_EDU_CHECK_ISOLATION=0: as on a machine where CUDA is initialised), threads
  and endless loops are still caught.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import numpy as np
import pytest

import lightning_edu
import lightning_edu.numpy_reference as reference
from lightning_edu.exercises import ExerciseError, IntegrityError, _isolation
from lightning_edu.exercises.ch03 import check_decay_mask
from lightning_edu.exercises.ch05 import check_reverse_sweep
from lightning_edu.exercises.ch10 import check_step
from lightning_edu.numpy_blockwise import block_factors, blockwise_backward



@pytest.fixture(autouse=True)
def _checks_in_a_child(request):
    """These tests crash and hang the reader's function on purpose: only where a check runs in a child (asked at
    each test: a GPU test before it may have initialised CUDA in this process). The tests of the kernel's own
    process set LIGHTNING_EDU_CHECK_ISOLATION=0 themselves and crash nothing."""
    reason = _isolation.in_process_reason()
    if reason is not None and "notebooks_process" not in request.node.name and "notebook_is_not" not in request.node.name:
        pytest.skip(f"checks run in the test's process here: {reason}")


def decay_mask(n, decay):  # the reader's own, right answer to 3.1
    t = np.arange(n)
    gap = t[:, None] - t[None, :]
    return np.where(gap >= 0, float(decay) ** np.maximum(gap, 0), 0.0)


def refused(check, fn, *words) -> str:
    with pytest.raises(IntegrityError) as info:
        check(fn)
    text = str(info.value)
    for word in words:
        assert word in text, text
    return text


# ------------------------------------------------------------------------------------------- threads


def test_a_call_from_a_thread_is_refused():
    def in_a_thread(n, decay):
        out = {}
        thread = threading.Thread(target=lambda: out.update(m=reference.decay_mask(n, decay)))
        thread.start()
        thread.join()
        return out.get("m", decay_mask(n, decay))  # the refusal is swallowed: the check still knows

    refused(check_decay_mask, in_a_thread,
            "your function in_a_thread calls lightning_edu.numpy_reference.decay_mask from a thread it started")


def test_10_1_through_threading_is_refused():  # the cohort's cheat
    def step(q, k, v, state, lam):
        out = {}

        def ask():
            out["r"] = lightning_edu.lightning_attention_step(q[None, None], k[None, None], v[None, None],
                                                              state[None, None], lam, backend="numpy")
        thread = threading.Thread(target=ask)
        thread.start()
        thread.join()
        new_state = lam * state + np.outer(k, v)
        return q @ new_state, new_state

    refused(check_step, step, "calls lightning_edu.lightning_attention_step from a thread it started")


def test_5_3_through_a_thread_pool_and_an_empty_loop_is_refused():  # the cohort's cheat
    def my_reverse_sweep(q, k, v, do, decay, block_size):
        with ThreadPoolExecutor(1) as pool:
            dk, dv = pool.submit(lambda: blockwise_backward(q, k, v, do, decay, block_size)[1:3]).result()
        for _ in range(0, q.shape[2], block_size):  # "one block at a time", by the line count
            pass
        return dk, dv

    refused(check_reverse_sweep, my_reverse_sweep,
            "calls lightning_edu.numpy_blockwise.blockwise_backward from a thread it started")


def test_an_allowed_helper_runs_in_a_thread_too(capsys):
    def my_reverse_sweep(q, k, v, do, decay, block_size):
        n = q.shape[2]
        starts = list(range(0, n, block_size))
        with ThreadPoolExecutor(2) as pool:  # block_factors (allowed) uses the package inside: that is fine
            factors = list(pool.map(lambda s: block_factors(min(s + block_size, n) - s, decay), starts))
        dk, dv = np.empty_like(k), np.empty_like(v)
        dkv = np.zeros(q.shape[:2] + (q.shape[-1], v.shape[-1]))
        for start, (mask, q_scale, k_scale, block_decay) in reversed(list(zip(starts, factors))):
            rows = slice(start, min(start + block_size, n))
            qi, ki, vi, doi = q[:, :, rows], k[:, :, rows], v[:, :, rows], do[:, :, rows]
            dk[:, :, rows] = ((doi @ vi.swapaxes(-1, -2)) * mask).swapaxes(-1, -2) @ qi + k_scale * (vi @ dkv.swapaxes(-1, -2))
            dv[:, :, rows] = ((qi @ ki.swapaxes(-1, -2)) * mask).swapaxes(-1, -2) @ doi + k_scale * (ki @ dkv)
            dkv = block_decay * dkv + (q_scale * qi).swapaxes(-1, -2) @ doi
        return dk, dv

    check_reverse_sweep(my_reverse_sweep)
    assert "Correct: reverse sweep right" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------- processes


def _fall_back(n, decay):
    return decay_mask(n, decay)


def test_a_call_from_a_forked_pool_is_refused():
    def forked_pool(n, decay):
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(1) as pool:
            try:
                return pool.apply(reference.decay_mask, (n, decay))
            except Exception:  # noqa: BLE001 - swallowed: the check still knows
                return _fall_back(n, decay)

    refused(check_decay_mask, forked_pool, "calls lightning_edu.numpy_reference.decay_mask in a process it started")


def test_a_call_from_a_spawned_pool_is_refused():
    def spawned_pool(n, decay):
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(1) as pool:  # a fresh Python: the sentinels find it
            try:
                return pool.apply(reference.decay_mask, (n, decay))
            except Exception:  # noqa: BLE001
                return _fall_back(n, decay)

    refused(check_decay_mask, spawned_pool, "calls lightning_edu.numpy_reference.decay_mask in a process it started")


def test_a_call_from_a_process_pool_executor_is_refused():
    def process_pool(n, decay):
        with ProcessPoolExecutor(1) as pool:
            return pool.submit(reference.decay_mask, n, decay).result()

    refused(check_decay_mask, process_pool, "decay_mask in a process it started")


def test_a_call_from_os_fork_is_refused():
    def forked(n, decay):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.write(write, reference.decay_mask(n, decay).tobytes())
            finally:
                os._exit(0)
        os.close(write)
        data = b""
        while chunk := os.read(read, 1 << 20):
            data += chunk
        os.waitpid(pid, 0)
        return np.frombuffer(data).reshape(n, n) if data else _fall_back(n, decay)

    refused(check_decay_mask, forked, "decay_mask in a process it started")


def test_a_call_from_a_python_subprocess_is_refused():
    def python_c(n, decay):
        import json
        import subprocess

        code = (f"import json, lightning_edu.numpy_reference as r; "
                f"print(json.dumps(r.decay_mask({n}, {decay}).tolist()))")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        return np.array(json.loads(done.stdout)) if done.returncode == 0 else _fall_back(n, decay)

    refused(check_decay_mask, python_c, "decay_mask in a process it started")


# ------------------------------------------------------------------------------------------- names


def test_importlib_and_getattr_are_refused_in_a_thread_too():
    def by_name(n, decay):
        module = importlib.import_module("lightning_edu." + "numpy_reference")
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(getattr(module, "decay" + "_mask"), n, decay).result()

    refused(check_decay_mask, by_name, "decay_mask from a thread it started")


def test_a_module_imported_during_the_call_is_switched_off_too():
    def fresh_import(n, decay):
        sys.modules.pop("lightning_edu.numpy_reference")  # in the check's process: the notebook keeps its module
        fresh = importlib.import_module("lightning_edu.numpy_reference")
        assert fresh is not reference
        return fresh.decay_mask(n, decay)

    refused(check_decay_mask, fresh_import, "calls lightning_edu.numpy_reference.decay_mask: write the algorithm")
    assert sys.modules["lightning_edu.numpy_reference"] is reference


# ------------------------------------------------------------------------------------------- crashes


@pytest.mark.parametrize("how, words", [
    (lambda: os._exit(3), "ended the process running the check, with exit code 3"),
    (lambda: __import__("ctypes").string_at(0), "crashed (SIGSEGV"),
    (lambda: os.kill(os.getpid(), signal.SIGKILL), "was killed (SIGKILL), most often by the system when the machine "
                                                   "runs out of memory"),
    (lambda: sys.exit(0), "raised SystemExit"),
], ids=["os_exit", "segfault", "sigkill", "sys_exit"])
def test_a_crash_fails_its_check_with_a_message_and_the_next_check_runs(how, words, capsys):
    def dies(n, decay):
        how()
        return decay_mask(n, decay)

    with pytest.raises(ExerciseError) as info:
        check_decay_mask(dies)
    assert words in str(info.value), str(info.value)
    if "SystemExit" not in words:
        assert "during its call with 7, 0.9" in str(info.value)
    check_decay_mask(decay_mask)
    assert "Correct: decay mask right" in capsys.readouterr().out


def test_what_the_check_and_the_function_print_comes_back_in_order(capsys):
    def chatty(n, decay):
        print(f"n = {n}")
        return decay_mask(n, decay)

    check_decay_mask(chatty)
    out = capsys.readouterr().out
    assert out.startswith("n = 7\n") and out.rstrip().endswith("(no overflow)"), out


# ------------------------------------------------------------------------------------------- loops


def loops_for_ever(n, decay):
    while True:
        pass


def ignores_the_stop(n, decay):
    while True:
        try:
            while True:
                pass
        except BaseException:  # noqa: BLE001 - the point: the child is then ended from outside
            pass


@pytest.mark.parametrize("answer", [loops_for_ever, ignores_the_stop])
def test_a_call_that_never_returns_is_stopped_and_named(answer, monkeypatch):
    monkeypatch.setenv("LIGHTNING_EDU_CALL_TIME_LIMIT", "1")
    start = time.monotonic()
    with pytest.raises(ExerciseError) as info:
        check_decay_mask(answer)
    took = time.monotonic() - start
    assert f"your function {answer.__name__} did not return within 1 s (called with 7, 0.9)" in str(info.value)
    assert took < 1 + _isolation._GRACE + 20, took


def test_a_check_has_a_limit_of_its_own(monkeypatch):
    from lightning_edu.exercises.ch07 import check_decay_tile

    monkeypatch.setenv("LIGHTNING_EDU_CHECK_TIME_LIMIT", "1")
    with pytest.raises(ExerciseError, match="did not finish within 1 s"):
        check_decay_tile(_kernel_that_sleeps)


class _kernel_that_sleeps:  # a "kernel" that never finishes its launch: the check's own limit ends it
    __name__ = "kernel_that_sleeps"

    def __getitem__(self, grid):
        return lambda *args, **kwargs: time.sleep(3600)


_kernel_that_sleeps = _kernel_that_sleeps()


def test_the_processes_a_function_starts_end_with_its_check(tmp_path):
    marker = tmp_path / "pid"

    def leaves_a_process(n, decay):
        import subprocess

        process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        marker.write_text(str(process.pid))
        return decay_mask(n, decay)

    check_decay_mask(leaves_a_process)
    pid = int(marker.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the process the function started outlived its check")


# ------------------------------------------------------------------------------------------- in the notebook's process


def test_in_the_notebooks_process_threads_and_loops_are_still_caught(monkeypatch):
    monkeypatch.setenv("LIGHTNING_EDU_CHECK_ISOLATION", "0")
    monkeypatch.setenv("LIGHTNING_EDU_CALL_TIME_LIMIT", "1")
    assert _isolation.in_process_reason() == "LIGHTNING_EDU_CHECK_ISOLATION=0"

    def in_a_pool(n, decay):
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(reference.decay_mask, n, decay).result()

    refused(check_decay_mask, in_a_pool, "decay_mask from a thread it started")
    with pytest.raises(ExerciseError, match="your function loops_for_ever did not return within 1 s"):
        check_decay_mask(loops_for_ever)
    assert reference.decay_mask(3, 0.5)[2, 0] == 0.25  # the package works again


def test_a_thread_of_the_notebook_is_not_the_readers(monkeypatch):
    # In the notebook's own process, a thread that was running before the call (the kernel's, a course tool's) may
    # use the package while a check runs: only the threads the reader's code starts are refused.
    monkeypatch.setenv("LIGHTNING_EDU_CHECK_ISOLATION", "0")
    go, done, results = threading.Event(), threading.Event(), []

    def background():
        go.wait(30)
        results.append(reference.decay_mask(3, 0.5)[2, 0])
        done.set()

    thread = threading.Thread(target=background, daemon=True)
    thread.start()

    def waits_for_the_other_thread(n, decay):
        go.set()
        done.wait(30)
        return decay_mask(n, decay)

    check_decay_mask(waits_for_the_other_thread)
    assert results == [0.25]


def test_after_a_stopped_call_traced_code_still_runs():
    # A call stopped in the kernel's own process, then a check that counts lines (sys.settrace): CPython 3.11 spins
    # for ever on traced code once a pending exception was taken back with PyThreadState_SetAsyncExc(id, NULL), which
    # the time limit once did. In a process of its own, so that a regression fails here instead of hanging the run.
    import subprocess

    code = (
        "import os\n"
        "os.environ.update(LIGHTNING_EDU_CHECK_ISOLATION='0', LIGHTNING_EDU_CALL_TIME_LIMIT='1')\n"
        "from lightning_edu.exercises.ch03 import check_decay_mask\n"
        "from lightning_edu.exercises import ExerciseError\n"
        "from lightning_edu.exercises._core import reader_lines\n"
        "def loops(n, decay):\n    while True:\n        pass\n"
        "try:\n    check_decay_mask(loops)\nexcept ExerciseError as exc:\n    print('stopped:', str(exc)[:40])\n"
        "print('lines:', reader_lines(lambda: sum(range(10)))[0])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1")))
    assert "stopped: your function loops did not return" in done.stdout, done.stdout + done.stderr
    assert "lines: 45" in done.stdout, done.stdout + done.stderr
