"""Measuring: the analytic cost model (:mod:`.costs`), CPU timing and memory (:mod:`.measure`), the torch
sweep of chapter 06 (:mod:`.torch_sweep`), the GPU benchmark beside the production libraries
(:mod:`.bench`) and the record of where each measurement was taken (:mod:`.environment`).
"""
