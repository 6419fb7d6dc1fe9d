"""What the measuring drivers share: the command line they refuse, and the record a GPU measurement starts from."""

from __future__ import annotations

from lightning_edu.environment import environment_record

__all__ = ["usage_refused", "gpu_record"]


def usage_refused(argv: list[str], doc: str, counts=(1,)) -> int | None:
    """The exit status for a command line a measuring module does not run: 0 after printing ``doc`` (the module's
    docstring, its usage) for ``-h``/``--help``; 2 after printing it for a wrong number of arguments or an output
    path that starts with a dash; None for a command line to run. So ``--help`` prints the usage instead of being
    taken for the output file."""
    if any(a in ("-h", "--help") for a in argv):
        print(doc)
        return 0
    if len(argv) not in counts or (argv and argv[0].startswith("-")):
        print(doc)
        return 2
    return None


def gpu_record(argv: list[str], doc: str, module: str, **fields) -> dict | int:
    """The record a measuring module on a GPU starts from, or the exit status of a command line it does not run:
    :func:`usage_refused`'s, or 1 on a machine without a CUDA device (after saying so). The record holds
    :func:`environment_record` of ``python -m benchmarks.<module> <argv>``, the given fields, and the
    device-to-device copy bandwidth measured now (``copy_bandwidth_bytes_per_s``, for the HBM floor)."""
    refused = usage_refused(argv, doc)
    if refused is not None:
        return refused
    import torch

    if not torch.cuda.is_available():
        print(f"python -m benchmarks.{module} measures on a CUDA GPU; none is available here.")
        return 1
    from lightning_edu.measure import copy_bandwidth

    return {**environment_record(f"python -m benchmarks.{module} " + " ".join(argv)), **fields,
            "copy_bandwidth_bytes_per_s": copy_bandwidth()}
