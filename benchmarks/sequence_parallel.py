"""One sequence over several GPUs: :func:`~lightning_edu.distributed.sequence_parallel_attention` launched by
torchrun, one process per device. (Chapter 12.)

    torchrun --standalone --nproc-per-node N -m benchmarks.sequence_parallel OUT.json [options]
    python -m benchmarks.sequence_parallel OUT.json [options]          # one process, world size 1

Options (defaults in brackets):
    --tokens N      the whole sequence's length, split over the ranks [262144]
    --heads H       heads [16];  --dim D: head dim, d_k = d_v = D [128]
    --backend B     each rank's local pass: triton, torch or auto [triton]
    --exchange E    allgather or ring [allgather]
    --dtype T       bfloat16, float16 or float32 [bfloat16]
    --repeats R     timed repeats of each measurement, after one untimed [10]
    --seed S        the sequence's seed [0]
    --save PATH     rank 0 writes (torch.save) the whole sequence's o, dq, dk, dv, gathered from every rank in rank
                    order: to compare world sizes (small sequences: every rank's slice passes through rank 0)

Rank r holds tokens [start_r, end_r) of one sequence (batch 1), the tokens split as evenly as they go; the inputs
are drawn chunk by chunk from the seed (:func:`slice_inputs`), so every world size sees the same sequence. On CUDA
each rank takes the device ``LOCAL_RANK`` and the group NCCL; without CUDA the ranks are CPU processes over gloo.
The per-head decays are :func:`~lightning_edu.models.decay.head_decays`.

The record (JSON, written by rank 0) holds the environment, the world size, the options and per rank: the slice,
the forward and the forward + backward (a fixed upstream gradient) in milliseconds (median of the repeats; CUDA
events on a GPU, the wall clock on CPU; the ranks meet at a barrier before each repeat), the peak memory beyond
the inputs (CUDA only, else None), and the bytes each rank sends per layer in the forward
(:func:`~lightning_edu.distributed.communication_bytes`: the states, against softmax's all-gather of K and V).
A command line it does not run prints one line and exits 2 on every rank, before any process group exists.
"""

from __future__ import annotations

import os
import statistics
import sys

__all__ = ["CHUNK", "parse", "slice_bounds", "slice_inputs", "main"]

#: The inputs are drawn CHUNK tokens at a time, chunk c from its own generator seeded by (seed, c).
CHUNK = 4096
_DTYPES = ("bfloat16", "float16", "float32")
_DEFAULTS = {"tokens": 262144, "heads": 16, "dim": 128, "backend": "triton", "exchange": "allgather",
             "dtype": "bfloat16", "repeats": 10, "seed": 0, "save": None}
_CHOICES = {"backend": ("triton", "torch", "auto"), "exchange": ("allgather", "ring"), "dtype": _DTYPES}
_POSITIVE = ("tokens", "heads", "dim", "repeats")


class Refused(ValueError):
    """A command line the driver does not run; its message is the one line it prints."""


def parse(argv: list[str]) -> dict:
    """The options of a command line: {"out": OUT.json, ...:data:`_DEFAULTS` overridden}. Raises :class:`Refused`
    for anything else (an unknown option, a missing or malformed value, no output path, two of them)."""
    options, out, rest = dict(_DEFAULTS), None, list(argv)
    while rest:
        arg = rest.pop(0)
        if arg.startswith("--"):
            name = arg[2:]
            if name not in _DEFAULTS:
                raise Refused(f"unknown option {arg}; the options are " + ", ".join(f"--{n}" for n in _DEFAULTS))
            if not rest or rest[0].startswith("--"):
                raise Refused(f"{arg} needs a value")
            value = rest.pop(0)
            if name in _POSITIVE or name == "seed":
                try:
                    number = int(value)
                except ValueError:
                    raise Refused(f"{arg} must be an integer, got {value!r}") from None
                if name in _POSITIVE and number < 1:
                    raise Refused(f"{arg} must be at least 1, got {number}")
                options[name] = number
            elif name in _CHOICES and value not in _CHOICES[name]:
                raise Refused(f"{arg} must be one of {', '.join(_CHOICES[name])}, got {value!r}")
            else:
                options[name] = value
        elif out is None and not arg.startswith("-"):
            out = arg
        else:
            raise Refused(f"unexpected argument {arg!r}: one output path (OUT.json) and --options")
    if out is None:
        raise Refused("no output path: python -m benchmarks.sequence_parallel OUT.json [options]")
    return {"out": out, **options}


def slice_bounds(tokens: int, world: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank ``rank``'s slice: ``tokens`` split into ``world`` contiguous slices in rank order, the
    first ``tokens % world`` of them one token longer."""
    size, extra = divmod(tokens, world)
    start = rank * size + min(rank, extra)
    return start, start + size + (rank < extra)


def slice_inputs(start: int, end: int, heads: int, dim: int, seed: int, dtype, device):
    """(q, k, v, do), each (1, heads, end - start, dim) in ``dtype`` on ``device``: tokens [start, end) of the
    sequence of ``seed``. Drawn in float32 on ``device``, CHUNK tokens at a time, chunk c from a generator seeded
    by ``seed * 1_000_003 + c``, then cut to the slice: the same tokens whatever the slicing (on one kind of
    device; CPU and CUDA generators draw different numbers). q and k are scaled by dim^-1/2, so that q k^T is of
    order one."""
    import torch

    parts = []
    for c in range(start // CHUNK, (end - 1) // CHUNK + 1):
        generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + c)
        chunk = torch.randn((4, heads, CHUNK, dim), generator=generator, device=device)
        lo, hi = max(start - c * CHUNK, 0), min(end - c * CHUNK, CHUNK)
        parts.append(chunk[:, :, lo:hi])
    x = torch.cat(parts, dim=2)[:, None]
    x[:2] *= dim ** -0.5
    return tuple(t.to(dtype).contiguous() for t in x)


def _timed(fn, repeats: int, cuda: bool, barrier) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` calls after one untimed call, the ranks meeting at a
    barrier before each call."""
    import time

    import torch

    fn()
    times = []
    for _ in range(repeats):
        barrier()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def _run(options: dict, rank: int, world: int, device) -> dict:
    """This rank's measurements (and, with --save, its o and gradients, as CPU tensors under "tensors")."""
    import torch
    import torch.distributed as dist

    from lightning_edu.distributed import communication_bytes, sequence_parallel_attention
    from lightning_edu.models.decay import head_decays

    dtype = getattr(torch, options["dtype"])
    start, end = slice_bounds(options["tokens"], world, rank)
    q, k, v, do = slice_inputs(start, end, options["heads"], options["dim"], options["seed"], dtype, device)
    decay = torch.tensor(head_decays(options["heads"]), dtype=torch.float32, device=device)
    cuda = device.type == "cuda"
    barrier = dist.barrier

    def attend(*xs):
        return sequence_parallel_attention(*xs, decay, backend=options["backend"], exchange=options["exchange"],
                                           offset=start)

    def forward():
        with torch.no_grad():
            attend(q, k, v)

    leaves = [x.detach().requires_grad_() for x in (q, k, v)]

    def forward_backward():
        for x in leaves:
            x.grad = None
        attend(*leaves).backward(do)

    result = {"rank": rank, "slice": [start, end], "forward_ms": _timed(forward, options["repeats"], cuda, barrier)}
    inputs_bytes = sum(x.numel() * x.element_size() for x in (q, k, v, do))
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
    result["forward_backward_ms"] = _timed(forward_backward, options["repeats"], cuda, barrier)
    result["peak_bytes_beyond_inputs"] = torch.cuda.max_memory_allocated(device) - baseline if cuda else None
    result["inputs_bytes"] = inputs_bytes
    sent = communication_bytes(options["tokens"], world, options["heads"], options["dim"], options["dim"],
                               torch.tensor([], dtype=dtype).element_size())
    result["bytes_sent_per_layer_forward"] = {"ours": sent[f"lightning_{options['exchange']}"],
                                              "softmax_allgather_kv": sent["softmax_allgather_kv"]}
    if options["save"]:
        o = attend(*leaves)
        for x in leaves:
            x.grad = None
        o.backward(do)
        result["tensors"] = {name: t.detach().cpu() for name, t in
                             zip(("o", "dq", "dk", "dv"), (o, *(x.grad for x in leaves)))}
    return result


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if any(a in ("-h", "--help") for a in argv):
        if rank == 0:
            print(__doc__)
        return 0
    try:
        options = parse(argv)
        if options["tokens"] < world:
            raise Refused(f"--tokens must be at least the world size {world}, got {options['tokens']}")
    except Refused as exc:
        if rank == 0:
            print(f"benchmarks.sequence_parallel: {exc}")
        return 2

    import torch
    import torch.distributed as dist

    from lightning_edu.environment import environment_record, save_record

    cuda = torch.cuda.is_available()
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        if options["backend"] == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
            if rank == 0:
                print("benchmarks.sequence_parallel: --backend triton needs CUDA here (or TRITON_INTERPRET=1 for "
                      "Triton's CPU interpreter); use --backend torch on CPU")
            return 2
    launched = "WORLD_SIZE" in os.environ  # by torchrun; else a group of one process, in memory
    group = {} if launched else {"store": dist.HashStore(), "rank": 0, "world_size": 1}
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None, **group)
    try:
        mine = _run(options, rank, world, device)
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return 0
    if options["save"]:
        torch.save({name: torch.cat([r["tensors"][name] for r in everyone], dim=2) for name in ("o", "dq", "dk", "dv")},
                   options["save"])
    for r in everyone:
        r.pop("tensors", None)
    command = ("torchrun --standalone --nproc-per-node " + str(world) if launched else "python") + \
        " -m benchmarks.sequence_parallel " + " ".join(argv)
    record = {**environment_record(command, device="cuda" if cuda else "cpu"), "world_size": world,
              "process_group": "nccl" if cuda else "gloo",
              **{name: value for name, value in options.items() if name not in ("out", "save")}, "ranks": everyone}
    save_record(options["out"], record)
    slowest = max(everyone, key=lambda r: r["forward_backward_ms"])
    print(f"{world} rank(s), {options['tokens']} tokens: forward {max(r['forward_ms'] for r in everyone):.3g} ms, "
          f"forward + backward {slowest['forward_backward_ms']:.3g} ms (slowest rank); record in {options['out']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
