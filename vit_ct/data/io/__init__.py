"""Reading CT files: one slice (DICOM, NIfTI, .npy) in Hounsfield units, the checks every reader shares, and whole scans
(DICOM series, NIfTI volumes) as an archive holds them."""
