"""The triton backend's kernels one by one under Nsight Compute: time, DRAM bytes, bandwidth, L2 hits,
occupancy. (Chapter 14.)

    python -m benchmarks.kernels OUT.json [--D 128 64] [--T 8192 32768 131072] [--anchors]

For each (D, T) at the benchmark's shapes (bf16, 16 heads, B = max(1, 32768 / T), so 32K tokens per call;
per-head decay as a CUDA tensor), a child process warms up, then runs one forward without grad (what inference
runs) and one forward + backward (what training runs) between ``cudaProfilerStart`` and ``cudaProfilerStop``.
``ncu --profile-from-start off`` profiles every launch of the backend's kernels there, each on its own: Nsight
Compute runs a kernel several times to read all its counters, restoring memory in between, and with its default
cache control it empties the caches before each run, so a kernel starts with nothing of its inputs in L2. The
clocks are left as they run (``--clock-control none``), as in the benchmark.

Per launch: which call and pass ran it ("forward", or "training forward" / "training backward"), the kernel and
whether it is an exact pass (``_tiles``: it redoes flagged programs; with these finite inputs, none), the grid, ``time_us``, the
bytes read from and written to DRAM, ``dram_TBps`` (those bytes over the time), ``dram_pct_of_peak`` (Nsight
Compute's DRAM throughput, percent of the peak), ``l2_hit_pct``, ``tensor_pipe_pct`` (the tensor cores' busy
cycles, percent of the active ones), the warps in flight per SM (``warps_active_pct``, percent of the SM's 64)
against what the launch allows (``warps_limit_pct``), the registers per thread, and the blocks per SM that
registers and shared memory each allow; from the compiled kernel, as Triton reports it: ``spilled_words`` (local
memory per thread, in 32-bit words: registers the compiler could not keep), ``shared_bytes``, ``warps`` and
``stages`` (its pipeline depth). ``tensor_bytes`` is one of q, k, v, o in bytes, the unit to read the
DRAM bytes in: the forward must read three of them and write one. With ``--anchors``, each shape also profiles
every kernel of fla's ``chunk_simple_gla`` forward (the closest library, when it imports), as the pass
:data:`ANCHOR`. One JSON record with the machine, versions, commit, the ncu version and its command.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys

from lightning_edu.book.profiles import ANCHOR, kernel_table, short_name  # noqa: F401 (what a record's reader uses)

__all__ = ["METRICS", "KERNELS", "parse_ncu_csv", "label_launches", "measure", "measure_anchor", "main"]

METRICS = {  # the record's name -> the Nsight Compute metric (Hopper)
    "time_ns": "gpu__time_duration.sum",
    "dram_read_bytes": "dram__bytes_read.sum",
    "dram_write_bytes": "dram__bytes_write.sum",
    "dram_pct_of_peak": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "l2_hit_pct": "lts__t_sector_hit_rate.pct",
    "tensor_pipe_pct": "sm__pipe_tensor_op_hmma_type_hmma_hgmma_qgmma_cycles_active.avg.pct_of_peak_sustained_active",
    "warps_active_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "warps_limit_pct": "sm__maximum_warps_per_active_cycle_pct",
    "registers": "launch__registers_per_thread",
    "blocks_per_sm_registers": "launch__occupancy_limit_registers",
    "blocks_per_sm_shared": "launch__occupancy_limit_shared_mem",
}

KERNELS = ("_la2_fast_forward_kernel", "_tma_forward_kernel", "_la2_fast_dkdv_kernel", "_la3_dkdv_kernel",
           "_segment_state_kernel")
"""The kernels the backend launches (ncu profiles only these)."""

_CHILD = r"""
import contextlib, json, sys, torch
from lightning_edu import lightning_attention
from lightning_edu.models.decay import head_decays
from lightning_edu.triton_kernels import _tiles, ops, plan
D, T = int(sys.argv[1]), int(sys.argv[2])
B, H = max(1, 32768 // T), 16
gen = torch.Generator(device="cuda").manual_seed(0)
q, k, v, do = (torch.randn(B, H, T, D, device="cuda", generator=gen).bfloat16() / 4 for _ in range(4))
decay = torch.tensor(head_decays(H), dtype=torch.float32, device="cuda")
leaves = [x.clone().requires_grad_() for x in (q, k, v)]
settings = contextlib.ExitStack()  # the whole child runs with replay off: every launch through _tiles.launch,
settings.enter_context(plan.override(replay=False))  # where it is noted
launches, where = [], ["forward"]
fast_launch = _tiles._fast_launch
def noted(kernel, grid, *args, **meta):
    compiled = fast_launch(kernel, grid, *args, **meta)
    launches.append({"pass": where[0], "kernel": kernel.fn.__name__, "grid": list(grid),
                     "exact": bool(meta.get("SAFE", False)), "spilled_words": compiled.n_spills,
                     "shared_bytes": compiled.metadata.shared, "warps": compiled.metadata.num_warps,
                     "stages": compiled.metadata.num_stages})
    return compiled
_tiles._fast_launch = noted
def inference():
    with torch.no_grad():
        lightning_attention(*leaves, decay, backend="triton")
def training():
    where[0] = "training forward"
    o = lightning_attention(*leaves, decay, backend="triton")
    where[0] = "training backward"
    o.backward(do)
    for x in leaves:
        x.grad = None
for _ in range(3):
    inference(); training()
torch.cuda.synchronize()
launches.clear(); where[0] = "forward"
torch.cuda.cudart().cudaProfilerStart()
inference(); torch.cuda.synchronize()
training(); torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
print("LAUNCHES " + json.dumps({"launches": launches, "tensor_bytes": q.numel() * q.element_size(), "batch": B}))
"""


def _number(text: str) -> float | None:
    text = text.replace(",", "").strip()
    if text in ("", "n/a"):
        return None
    return float(text)


def parse_ncu_csv(text: str) -> list[dict]:
    """Rows of ``ncu --csv --page raw`` output, one per profiled launch: {"kernel", "grid", and every name of
    :data:`METRICS` whose metric is a column} (numbers as floats; ncu's thousands separators removed). Lines
    that are not part of the table (ncu's ``==PROF==`` and ``==WARNING==`` notes) are skipped; the second row,
    the units, too."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    table = list(csv.reader(io.StringIO("\n".join(lines))))
    if not table:
        return []
    header, body = table[0], table[2:]
    column = {name: header.index(metric) for name, metric in METRICS.items() if metric in header}
    rows = []
    for values in body:
        row = {"kernel": values[header.index("Kernel Name")],
               "grid": [int(x) for x in values[header.index("Grid Size")].strip("()").split(",")]}
        row.update({name: _number(values[i]) for name, i in column.items()})
        rows.append(row)
    return rows


def label_launches(rows: list[dict], launches: list[dict], tensor_bytes: int) -> list[dict]:
    """ncu's rows matched one to one, in order, with the launches the child noted ({"pass", "kernel", "grid",
    "exact"}), and the derived figures added: ``time_us``, ``dram_TBps`` and the DRAM bytes in tensors.
    Raises ValueError when the two lists disagree (count, kernel or grid), rather than label a row wrongly, and when
    a row lacks the time or the DRAM bytes the rates are derived from."""
    if len(rows) != len(launches):
        raise ValueError(f"ncu profiled {len(rows)} launches, the program noted {len(launches)}")
    out = []
    for i, (row, noted) in enumerate(zip(rows, launches)):
        grid = noted["grid"] + [1] * (3 - len(noted["grid"]))
        if row["kernel"] != noted["kernel"] or row["grid"] != grid:
            raise ValueError(f"launch {i}: ncu saw {row['kernel']} on {row['grid']}, the program noted "
                             f"{noted['kernel']} on {grid}")
        missing = [name for name in ("time_ns", "dram_read_bytes", "dram_write_bytes") if row.get(name) is None]
        if missing:
            raise ValueError(f"launch {i}: ncu gave no value for {', '.join(missing)}")
        time_s = row["time_ns"] * 1e-9
        moved = row["dram_read_bytes"] + row["dram_write_bytes"]
        compiled = {key: noted[key] for key in ("spilled_words", "shared_bytes", "warps", "stages") if key in noted}
        out.append({"pass": noted["pass"], "exact": noted["exact"], **row, **compiled,
                    "time_us": round(row["time_ns"] / 1e3, 2),
                    "dram_TBps": round(moved / time_s / 1e12, 3) if time_s > 0 else None,
                    "read_tensors": round(row["dram_read_bytes"] / tensor_bytes, 3),
                    "written_tensors": round(row["dram_write_bytes"] / tensor_bytes, 3)})
    return out


def ncu_command(kernels: tuple[str, ...] | None = KERNELS) -> list[str]:
    """The ncu command line, without the program it profiles: only ``kernels`` profiled (by name), or every
    kernel when None."""
    names = [] if kernels is None else ["--kernel-name", f"regex:^({'|'.join(kernels)})$"]
    return ["ncu", "--clock-control", "none", "--profile-from-start", "off", "--csv", "--page", "raw", *names,
            "--metrics", ",".join(METRICS.values())]


"""The pass name of the library's forward that ``--anchors`` profiles beside ours."""

_ANCHOR_CHILD = r"""
import sys, numpy as np, torch
from fla.ops.simple_gla import chunk_simple_gla
from lightning_edu.models.decay import head_decays
D, T = int(sys.argv[1]), int(sys.argv[2])
B, H = max(1, 32768 // T), 16
gen = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(B, T, H, D, device="cuda", generator=gen).bfloat16() / 4 for _ in range(3))  # its layout
g_gamma = torch.tensor(np.log(head_decays(H)), dtype=torch.float32, device="cuda")
def inference():
    with torch.no_grad():
        chunk_simple_gla(q, k, v, g_gamma=g_gamma, scale=1.0)
for _ in range(3):
    inference()  # the first call autotunes
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
inference(); torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
print("TENSOR_BYTES", q.numel() * q.element_size())
"""


def _profiled(child: str, D: int, T: int, marker: str, kernels: tuple[str, ...] | None) -> tuple[list[dict], str]:
    """Run ``child`` (Python source, given D and T) under ncu, profiling ``kernels`` (every kernel when None):
    (ncu's rows, what the child printed after ``marker`` on its last such line). Raises RuntimeError with the
    child's output when it fails or prints no ``marker`` line."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([*ncu_command(kernels), sys.executable, "-c", child, str(D), str(T)], capture_output=True,
                          text=True, env=env)
    noted = [line for line in proc.stdout.splitlines() if line.startswith(marker + " ")]
    if proc.returncode != 0 or not noted:
        raise RuntimeError(f"ncu run failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return parse_ncu_csv(proc.stdout), noted[-1][len(marker) + 1:]


def measure_anchor(D: int, T: int) -> list[dict]:
    """fla's ``chunk_simple_gla`` forward (no grad, inputs in its (batch, T, heads, d) layout, decay as
    ``g_gamma = log(lambda)``, scale 1) at the shape of :func:`measure`, every kernel it launches under ncu, labelled
    with the pass :data:`ANCHOR`."""
    rows, tensor_bytes = _profiled(_ANCHOR_CHILD, D, T, "TENSOR_BYTES", None)
    launches = [{"pass": ANCHOR, "kernel": row["kernel"], "grid": row["grid"], "exact": False} for row in rows]
    return label_launches(rows, launches, int(tensor_bytes))


def measure(D: int, T: int) -> dict:
    """One (D, T): the child under ncu, its launches labelled."""
    rows, noted = _profiled(_CHILD, D, T, "LAUNCHES", KERNELS)
    child = json.loads(noted)
    return {"D": D, "T": T, "batch": child["batch"], "heads": 16, "tensor_bytes": child["tensor_bytes"],
            "launches": label_launches(rows, child["launches"], child["tensor_bytes"])}


def main(argv=None) -> int:
    from lightning_edu.environment import environment_record, save_record

    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--D", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--T", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--anchors", action="store_true",
                        help="also profile fla's chunk_simple_gla forward at each shape (fla must import)")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available() or shutil.which("ncu") is None:
        print("needs a CUDA device and Nsight Compute's ncu on the PATH")
        return 2
    version = subprocess.run(["ncu", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    argv = sys.argv[1:] if argv is None else argv
    record = {**environment_record("python -m benchmarks.kernels " + " ".join(argv)), "ncu": version,
              "ncu_command": " ".join(ncu_command()), "dtype": "bfloat16", "results": []}
    if args.anchors:
        from importlib.metadata import version as installed

        record.update(fla=installed("fla-core"), ncu_command_anchors=" ".join(ncu_command(None)))
    for D in args.D:
        for T in args.T:
            shape = measure(D, T)
            if args.anchors:
                shape["launches"] += measure_anchor(D, T)
            record["results"].append(shape)
            for x in shape["launches"]:
                print(f"D={D} T={T} {x['pass']:18s} {x['kernel'][:40]:26s}{' exact' if x['exact'] else '':6s} "
                      f"grid={x['grid']} {x['time_us']:9.2f} us read {x['read_tensors']:.2f} wrote "
                      f"{x['written_tensors']:.2f} tensors {x['dram_TBps']} TB/s ({x['dram_pct_of_peak']}% of peak) "
                      f"L2 hit {x['l2_hit_pct']}% tensor pipe {x['tensor_pipe_pct']}% warps {x['warps_active_pct']}"
                      f"/{x['warps_limit_pct']}% regs {x['registers']}", flush=True)
            save_record(args.out, record)  # after every shape: a run cut short still leaves what it measured
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
