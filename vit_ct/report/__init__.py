"""``vit-ct report``, the evidence of a predict output with intervals by patient.

Detection, calibration, map and subgroup figures of a ``vit-ct predict`` output (and of other
models' predictions beside it), each with a 95% interval over patients, as ``report.html`` and ``report.json``."""
