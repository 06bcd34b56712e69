"""vit-ct's measurements: each module a benchmark run from the checkout as ``python -m benchmarks.NAME``, writing its
record under ``benchmarks/records/`` (:mod:`benchmarks.recording`), from which ``python -m benchmarks.docs`` writes
every figure of the README and docs. Not part of the installed package."""
