"""benchmarks.kernels: reading Nsight Compute's CSV, matching its rows to the launches a program noted,
the table the chapters show, and the recorded H100 run. (The measurement itself needs a GPU and ncu.)"""

import json
import math
from pathlib import Path

import pytest

from benchmarks import kernels
from lightning_edu.book import profiles

DATA = Path(__file__).resolve().parents[2] / "notebooks" / "data"

# What `ncu --csv --page raw` prints, cut down to a few columns: its notes, a header, the units, then one row per
# launch, numbers with thousands separators.
NCU_CSV = """==PROF== Connected to process 580 (/usr/bin/python3.12)
==WARNING== Note: Running with unmodified GPU clocks.
"ID","Kernel Name","Grid Size","gpu__time_duration.sum","dram__bytes_read.sum","dram__bytes_write.sum","lts__t_sector_hit_rate.pct","launch__registers_per_thread"
"","","","ns","byte","byte","%","register/thread"
"0","_segment_state_kernel","(16, 15, 1)","47,328","125,844,736","2,396,416","4.09","66"
"1","_la2_fast_forward_kernel","(16, 1, 1)","2,880","29,952","0","96.41","253"
==PROF== Disconnected from process 580
"""


def test_parse_ncu_csv_reads_each_launch_and_skips_notes_and_units():
    rows = kernels.parse_ncu_csv(NCU_CSV)
    assert [r["kernel"] for r in rows] == ["_segment_state_kernel", "_la2_fast_forward_kernel"]
    assert rows[0]["grid"] == [16, 15, 1] and rows[1]["grid"] == [16, 1, 1]
    assert rows[0]["time_ns"] == 47328.0 and rows[0]["dram_read_bytes"] == 125844736.0
    assert rows[0]["dram_write_bytes"] == 2396416.0 and rows[1]["l2_hit_pct"] == 96.41 and rows[1]["registers"] == 253
    assert "dram_pct_of_peak" not in rows[0]  # a metric that is not a column is left out, not invented
    assert kernels.parse_ncu_csv("==PROF== nothing profiled\n") == []


def _launches():
    return [{"pass": "forward", "kernel": "_segment_state_kernel", "grid": [16, 15, 1], "exact": False,
             "spilled_words": 0, "shared_bytes": 49152, "warps": 4, "stages": 4},
            {"pass": "forward", "kernel": "_la2_fast_forward_kernel", "grid": [16], "exact": True}]


def test_label_launches_joins_the_rows_to_the_noted_launches_and_derives_the_rates():
    rows = kernels.parse_ncu_csv(NCU_CSV)
    out = kernels.label_launches(rows, _launches(), tensor_bytes=2**26)
    assert [(x["pass"], x["exact"]) for x in out] == [("forward", False), ("forward", True)]
    assert out[0]["time_us"] == 47.33
    assert math.isclose(out[0]["dram_TBps"], (125844736 + 2396416) / 47328e-9 / 1e12, abs_tol=1e-3)
    assert out[0]["read_tensors"] == round(125844736 / 2**26, 3) and out[1]["written_tensors"] == 0.0
    assert out[0]["spilled_words"] == 0 and out[0]["shared_bytes"] == 49152 and "spilled_words" not in out[1]


@pytest.mark.parametrize("mistake", ["one launch fewer", "another kernel", "another grid", "no time"])
def test_label_launches_refuses_rows_that_do_not_match(mistake):
    rows, noted = kernels.parse_ncu_csv(NCU_CSV), _launches()
    if mistake == "one launch fewer":
        noted = noted[:1]
        match = "ncu profiled 2 launches, the program noted 1"
    elif mistake == "another kernel":
        noted[1]["kernel"] = "_la3_dkdv_kernel"
        match = "launch 1: ncu saw _la2_fast_forward_kernel on \\[16, 1, 1\\], the program noted _la3_dkdv_kernel"
    elif mistake == "another grid":
        noted[0]["grid"] = [16, 7, 1]
        match = "launch 0: ncu saw _segment_state_kernel on \\[16, 15, 1\\]"
    else:
        rows[1]["time_ns"] = None  # an "n/a" in ncu's table
        match = "launch 1: ncu gave no value for time_ns"
    with pytest.raises(ValueError, match=match):
        kernels.label_launches(rows, noted, tensor_bytes=2**26)


def _record():
    row = {"time_us": 100.0, "read_tensors": 3.0, "written_tensors": 1.0, "dram_TBps": 2.5, "dram_pct_of_peak": 75.0,
           "l2_hit_pct": 30.0, "tensor_pipe_pct": 20.0, "warps_active_pct": 12.0, "warps_limit_pct": 12.5,
           "registers": 171.0, "spilled_words": 0}
    return {"results": [
        {"D": 64, "T": 8192, "launches": [{**row, "pass": "forward", "kernel": "_la2_fast_forward_kernel",
                                           "grid": [64, 1, 2], "exact": False},
                                          {**row, "pass": "forward", "kernel": "_la2_fast_forward_kernel",
                                           "grid": [8, 1, 1], "exact": True}]},
        {"D": 64, "T": 32768, "launches": [{**row, "pass": "training backward", "kernel": "_la3_dkdv_kernel",
                                            "grid": [16, 16, 1], "exact": False}]}]}


def test_kernel_table_filters_passes_exact_passes_and_lengths():
    table = profiles.kernel_table(_record()).splitlines()
    assert len(table) == 3  # header, rule, the one forward launch that is not an exact pass
    assert table[2] == ("| 64 | 8K | forward | `la2_fast_forward` | 64 x 1 x 2 | 100.0 | 3.00 / 1.00 | 2.50 | 75 | 30 "
                        "| 20 | 7.7 (8) | 171 (0) |")
    assert len(profiles.kernel_table(_record(), exact=True).splitlines()) == 4
    assert "(exact pass)" in profiles.kernel_table(_record(), exact=True)
    backward = profiles.kernel_table(_record(), passes=("training backward",))
    assert "`la3_dkdv`" in backward and "forward" not in backward.splitlines()[2]
    anchor = _record()
    anchor["results"][1]["launches"][0] = {k: v for k, v in anchor["results"][1]["launches"][0].items() if k != "spilled_words"}
    assert profiles.kernel_table(anchor, passes=("training backward",)).endswith("| 7.7 (8) | 171 |")  # no spills known
    assert len(profiles.kernel_table(_record(), passes=("training backward",), lengths=(8192,)).splitlines()) == 2


def test_the_ncu_command_reads_every_metric_with_the_clocks_left_alone():
    command = kernels.ncu_command()
    assert command[:3] == ["ncu", "--clock-control", "none"] and "--profile-from-start" in command
    assert command[command.index("--metrics") + 1].split(",") == list(kernels.METRICS.values())
    pattern = command[command.index("--kernel-name") + 1]
    assert all(name in pattern for name in kernels.KERNELS)
    assert "--kernel-name" not in kernels.ncu_command(None)  # the library's forward: every kernel it launches


@pytest.mark.parametrize("name", ["kernels_h100.json", "kernels_h200.json"])
def test_the_records_were_made_by_the_code_as_it_stands(name):
    """The chapters read the record as this module writes it today: the same ncu command (metrics, kernels), the
    passes in the program's order, every metric, and each of our launches a kernel of the backend's with what the
    compiler reported. (Its derived columns follow from its counters by label_launches, tested above.)"""
    record = json.loads((DATA / name).read_text())
    assert record["ncu_command"] == " ".join(kernels.ncu_command())
    for shape in record["results"]:
        passes = [x["pass"] for x in shape["launches"]]
        assert passes == sorted(passes, key=["forward", "training forward", "training backward", profiles.ANCHOR].index)
        for x in shape["launches"]:
            assert set(kernels.METRICS) <= set(x)
            if x["pass"] != profiles.ANCHOR:  # ours: the backend's kernels, with what the compiler reported
                assert x["kernel"] in kernels.KERNELS
                assert {"spilled_words", "shared_bytes", "warps", "stages"} <= set(x)


def test_without_a_gpu_or_ncu_it_says_so_and_writes_nothing(tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert kernels.main([str(tmp_path / "out.json")]) == 2
    assert "needs a CUDA device and Nsight Compute" in capsys.readouterr().out and list(tmp_path.iterdir()) == []


def test_short_names_drop_what_a_table_does_not_need():
    assert profiles.short_name("_la2_fast_forward_kernel") == "la2_fast_forward"
    assert profiles.short_name("chunk_fwd_kernel_h") == "chunk_fwd_kernel_h"
    assert profiles.short_name("void at::vectorized_elementwise_kernel<4, at::AUnaryFunctor<float>>(int, T2, T3)") \
        == "at::vectorized_elementwise"


def test_the_library_run_labels_every_row_ncu_gave_and_a_failed_run_says_what_it_printed(monkeypatch):
    import subprocess

    outputs = {"ok": NCU_CSV + "TENSOR_BYTES 67108864\n", "failed": "Traceback: no module named fla\n"}
    run_as = ["ok"]

    def fake_run(command, **kwargs):
        assert command[:3] == ["ncu", "--clock-control", "none"] and "--kernel-name" not in command
        return subprocess.CompletedProcess(command, 0 if run_as[0] == "ok" else 1, outputs[run_as[0]], "")

    monkeypatch.setattr(kernels.subprocess, "run", fake_run)
    launches = kernels.measure_anchor(64, 32768)
    assert [(x["pass"], x["kernel"]) for x in launches] == [(profiles.ANCHOR, "_segment_state_kernel"),
                                                             (profiles.ANCHOR, "_la2_fast_forward_kernel")]
    assert launches[0]["read_tensors"] == round(125844736 / 67108864, 3)
    run_as[0] = "failed"
    with pytest.raises(RuntimeError, match="ncu run failed \\(exit 1\\):\nTraceback: no module named fla"):
        kernels.measure_anchor(64, 32768)
