"""Benchmarks of the zoo: ``python -m attnzoo bench`` (timing grid to CSV), ``plot`` (figures), ``io`` (HBM traffic).

Modules: :mod:`.schema` (CSV columns and FLOP counts), :mod:`.machine` (GPU/driver/version metadata),
:mod:`.impls` (every timed implementation behind one adapter), :mod:`.timing` (medians with CUDA events or
``perf_counter``), :mod:`.run`, :mod:`.plot`, :mod:`.io_theory`, :mod:`.ncu` and :mod:`.io`.
"""
