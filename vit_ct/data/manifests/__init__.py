"""The manifest CSV: reading and checking it, the pre-run check of its files, copies, labels (slice and scan) and the
split by patient."""
