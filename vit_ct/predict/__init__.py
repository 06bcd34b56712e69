"""What ``vit-ct predict`` writes.

predictions.csv, maps and overlays, never mixed with another run's (:mod:`~vit_ct.predict.writer`), scans.csv and
NIfTI volumes (:mod:`~vit_ct.predict.scan_writer`), and the DICOM objects of ``--dicom_out``
(:mod:`~vit_ct.predict.dicom_scan`, :mod:`~vit_ct.predict.dicom_objects`)."""
