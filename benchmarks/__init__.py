"""The measuring drivers and experiments behind the records in notebooks/data/: each runs from the repository root as
``python -m benchmarks.<driver> ...`` and writes one JSON record (machine, versions, commit, command).

They import :mod:`lightning_edu`; the package never imports them. ``bench`` times the backend beside the
production libraries; ``kernels`` profiles each launch under Nsight Compute; ``figure3``, ``host``, ``first_call``,
``decode``, ``tgs`` and ``quality`` measure what chapters 08, 10 and 13 show; ``torch_sweep`` and ``drift`` record
chapter 06's and 10's measurements at full size; ``la3_sweep``, ``lookback``, ``tma``, ``prepass``, ``redo``,
``segments`` and ``slices`` are the experiments behind the kernels' choices (chapter 14), each comparing the
variants through explicit arguments.
"""
