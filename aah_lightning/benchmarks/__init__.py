"""Benchmarks: what the benchmark tools share (``common``: the paper's window mix, the benchmark models, interleaved
timing, tables, target verdicts) and the stages of ``tools/gpu_tune.py`` (``gpu_tune``)."""
