"""Kernel profiles recorded under Nsight Compute (``python -m benchmarks.kernels``), as the tables of chapters 07-08."""

from __future__ import annotations

__all__ = ["ANCHOR", "kernel_table", "short_name"]

ANCHOR = "fla chunk_simple_gla forward"


def short_name(kernel: str) -> str:
    """A kernel's name for a table: ours without the leading underscore and the ``_kernel`` suffix; a C++ kernel's
    (torch's) without its return type, template arguments and parameters."""
    name = kernel.removeprefix("void ")
    for cut in ("<", "("):
        name = name.split(cut)[0]
    return name.strip("_").removesuffix("_kernel")


def kernel_table(record: dict, passes: tuple[str, ...] = ("forward",), exact: bool = False,
                 lengths: tuple[int, ...] | None = None) -> str:
    """A Markdown table of a record's launches in ``passes``, in launch order per shape (exact passes only with
    ``exact``; sequence lengths in ``lengths``, all when None): shape, pass, kernel, grid, time, DRAM bytes read
    and written in tensors, TB/s and percent of the DRAM peak, L2 hit rate, tensor pipe, warps in flight per SM
    against the launch's limit, registers per thread (and the 32-bit words spilled to local memory)."""
    lines = ["| D | T | pass | kernel | grid | µs | DRAM read / written (tensors) | TB/s | % of DRAM peak | "
             "L2 hits % | tensor pipe % | warps per SM (limit) | registers (spilled) |",
             "|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for shape in record["results"]:
        if lengths is not None and shape["T"] not in lengths:
            continue
        for x in shape["launches"]:
            if x["pass"] not in passes or (x["exact"] and not exact):
                continue
            name = short_name(x["kernel"]) + (" (exact pass)" if x["exact"] else "")
            warps, limit = x["warps_active_pct"] * 64 / 100, x["warps_limit_pct"] * 64 / 100
            spilled = f" ({x['spilled_words']})" if "spilled_words" in x else ""  # known for our kernels only
            lines.append(f"| {shape['D']} | {shape['T'] // 1024}K | {x['pass']} | `{name}` | "
                         f"{' x '.join(map(str, x['grid']))} | {x['time_us']:.1f} | "
                         f"{x['read_tensors']:.2f} / {x['written_tensors']:.2f} | {x['dram_TBps']:.2f} | "
                         f"{x['dram_pct_of_peak']:.0f} | {x['l2_hit_pct']:.0f} | {x['tensor_pipe_pct']:.0f} | "
                         f"{warps:.1f} ({limit:.0f}) | {x['registers']:.0f}{spilled} |")
    return "\n".join(lines)
