"""Measuring: the analytic cost model (:mod:`.costs`), CPU timing and memory (:mod:`.measure`), the torch
sweep of chapter 06 (:mod:`.torch_sweep`), the GPU benchmark beside the production libraries
(:mod:`.bench`), the paper's Figure 3 on a GPU (:mod:`.figure3`), the host's share of a short call
(:mod:`.host`), the first call's compile time (:mod:`.first_call`), training speed (:mod:`.tgs`), quality
(:mod:`.quality`), decoding (:mod:`.decode`), a state's drift (:mod:`.drift`), the LA-3 sweep (:mod:`.la3_sweep`),
what each kernel uses on chip (:mod:`.resources`), and the record of where each measurement was taken
(:mod:`.environment`).
"""
