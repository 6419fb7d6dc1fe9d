"""What a short call costs the host: the triton backend's forward + backward, one layer of the call at a time.
(Chapter 14.)

    python -m benchmarks.host OUT.json [--d 64] [--T 256]

On a short sequence the kernels finish before the host has launched the next one, so the host's time per call
is the call's time. Each row times the same forward + backward (bf16, 1 x 4 heads x T tokens, per-head decay
as a CUDA tensor, gradients set to None after each call, as a training step does); rows 3-5 add one layer of
the call at a time, the sixth is the public function, the last two autograd's engine alone:

1. ``kernels, Triton's launch``: row 2 with every kernel launched through Triton's ``kernel[grid]``
   (``fast_launch`` off), for the cost of Triton's launch-time work;
2. ``kernels, launchers' host code``: the launchers alone (:func:`~lightning_edu.triton_kernels.ops.forward_impl`,
   then :func:`~lightning_edu.triton_kernels.ops.backward_impl` on the saved states), no autograd, with their
   host code run on every call (``replay`` off);
3. ``kernels``: the same, as the backend runs them: from the second call on, the launches recorded at the first
   call with these shapes are replayed (:class:`~lightning_edu.triton_kernels._tiles.LaunchPlan`);
4. ``autograd Function``: the same, as :class:`~lightning_edu.triton_kernels.ops.EagerLA2` under autograd;
5. ``custom op``: the same, through the dispatcher, as the op ``lightning_edu::la2_forward`` and its registered
   backward (what :func:`torch.compile` calls);
6. ``lightning_attention``: the public function (validation, the decay's log2, the eager door of row 4);
7. ``lightning_attention, backward on the caller``: row 6 with autograd's engine told to run the backward on the
   thread that calls ``backward()`` (``torch.autograd.set_multithreading_enabled(False)``) instead of handing it to
   its CUDA device thread;
8. ``hand-off alone``: no attention at all, an autograd Function whose forward copies a 16-element CUDA tensor and
   whose backward returns the gradient it is given: what autograd's engine costs the host for one node on a
   CUDA tensor, its hand-off to the device thread and back included;
9. ``hand-off alone, backward on the caller``: row 8 with the backward on the calling thread, as in row 7.

Host microseconds per call, the median and the minimum over interleaved rounds (each round runs every row
``calls`` times between two synchronisations, so drifts of the machine hit every row alike); and, for row 3,
its time by device events (``triton.testing.do_bench``), which on a call this short includes the GPU's idle
gaps while it waits for the host. The rows are measured twice: as the process runs by default (``results``),
and again in a child process confined to one CPU core (``results_one_core``), where autograd's device thread
runs on the core that the main thread left warm. One JSON record with the machine, versions, commit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

__all__ = ["ROWS", "measure", "main"]

ROWS = ("kernels, Triton's launch", "kernels, launchers' host code", "kernels", "autograd Function", "custom op",
        "lightning_attention", "lightning_attention, backward on the caller", "hand-off alone",
        "hand-off alone, backward on the caller")


def _calls(d: int, T: int, heads: int = 4):
    import torch

    from lightning_edu import lightning_attention
    from lightning_edu.models.decay import head_decays
    from lightning_edu.triton_kernels import log2_decay_tensor, plan
    from lightning_edu.triton_kernels.ops import EagerLA2, backward_impl, forward_impl, la2_forward

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(1, heads, T, d, device="cuda", generator=gen).bfloat16() / 4 for _ in range(4))
    decay = torch.tensor(head_decays(heads), dtype=torch.float32, device="cuda")
    l2 = log2_decay_tensor(decay, "cuda")
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]

    def step(o):
        o.backward(do)
        for x in leaves:
            x.grad = None

    def kernels():
        _, _, incoming = forward_impl(q, k, v, l2, None, None, True)
        backward_impl(q, k, v, do, l2, None, None, incoming, d_initial_state=False)  # as the eager door calls it

    def on_caller():
        with torch.autograd.set_multithreading_enabled(False):
            step(lightning_attention(*leaves, decay, backend="triton"))

    class Copy(torch.autograd.Function):  # one node on a CUDA tensor, no work of its own
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad

    small = torch.zeros(16, device="cuda", requires_grad=True)
    small_grad = torch.ones(16, device="cuda")

    def hand_off():
        Copy.apply(small).backward(small_grad)
        small.grad = None

    def hand_off_on_caller():
        with torch.autograd.set_multithreading_enabled(False):
            hand_off()

    def without(*switches):
        # kernels() with the backend's settings of these names off for the call (plan.override)
        def run():
            with plan.override(**dict.fromkeys(switches, False)):
                kernels()
        return run

    return {
        "kernels, Triton's launch": without("fast_launch", "replay"),
        "kernels, launchers' host code": without("replay"),
        "kernels": kernels,
        "autograd Function": lambda: step(EagerLA2.apply(*leaves, l2, None, None, True)[0]),
        "custom op": lambda: step(la2_forward(*leaves, l2, None, None, True)[0]),
        "lightning_attention": lambda: step(lightning_attention(*leaves, decay, backend="triton")),
        "lightning_attention, backward on the caller": on_caller,
        "hand-off alone": hand_off,
        "hand-off alone, backward on the caller": hand_off_on_caller,
    }


def measure(d: int = 64, T: int = 256, rounds: int = 15, calls: int = 20) -> list[dict]:
    """Rows of {"layer", "host_us_median", "host_us_min"} (and "gpu_us" for the kernels row), on CUDA."""
    import torch
    import triton.testing

    fns = _calls(d, T)
    for fn in fns.values():
        for _ in range(5):  # compiled, allocator warm
            fn()
    torch.cuda.synchronize()
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter() - start) / calls * 1e6)
            torch.cuda.synchronize()
    rows = [{"layer": name, "host_us_median": round(statistics.median(xs), 1), "host_us_min": round(min(xs), 1)}
            for name, xs in samples.items()]
    rows[ROWS.index("kernels")]["gpu_us"] = round(triton.testing.do_bench(fns["kernels"], warmup=25, rep=200) * 1e3, 1)
    return rows


def main(argv=None) -> int:
    from lightning_edu.environment import environment_record, save_record

    parser = argparse.ArgumentParser(prog="python -m benchmarks.host", description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--T", type=int, default=256)
    parser.add_argument("--rows-only", action="store_true", help="print the rows as JSON and write nothing")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    if args.rows_only:
        print(json.dumps(measure(args.d, args.T)))
        return 0
    argv = sys.argv[1:] if argv is None else argv
    command = "python -m benchmarks.host " + " ".join(argv)
    record = {**environment_record(command), "shape": {"batch": 1, "heads": 4, "T": args.T, "d": args.d},
              "dtype": "bfloat16", "results": measure(args.d, args.T)}
    # The same rows in a fresh process confined to one core (every thread it starts inherits the mask).
    core = min(os.sched_getaffinity(0))
    child = subprocess.run([sys.executable, "-m", "benchmarks.host", args.out, "--d", str(args.d),
                            "--T", str(args.T), "--rows-only"], capture_output=True, text=True, check=True,
                           preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    record["one_core"] = core
    record["results_one_core"] = json.loads(child.stdout.strip().splitlines()[-1])
    save_record(args.out, record)
    for key in ("results", "results_one_core"):
        print(key)
        for row in record[key]:
            print(" ", row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
