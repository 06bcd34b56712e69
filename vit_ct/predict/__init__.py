"""What ``vit-ct predict`` and ``vit-ct manifest`` write.

What ``vit-ct predict`` writes (:mod:`~vit_ct.predict.writer`: predictions.csv, maps, overlays, never mixed with
another run's; :mod:`~vit_ct.predict.scan_writer`: scans.csv and NIfTI volumes), and ``vit-ct manifest``
(:mod:`~vit_ct.predict.manifest_command`: a manifest of a DICOM archive, labels left to fill in)."""
