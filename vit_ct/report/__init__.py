"""``vit-ct report``: detection, calibration, map and subgroup figures of a ``vit-ct predict`` output (and of other
models' predictions beside it), each with a 95% interval over patients, as ``report.html`` and ``report.json``."""
