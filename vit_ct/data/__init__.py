"""Reading CT and building batches: DICOM / NIfTI / npy slices in Hounsfield units, windows, the manifest and its
checks, whole scans, the data modules and their typed batches. Imports nothing else of vit-ct but
:mod:`vit_ct.files`."""
