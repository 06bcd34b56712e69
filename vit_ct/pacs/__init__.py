"""A PACS round trip over DICOMweb: a study's CT series in, ``vit-ct predict``'s DICOM objects back into the study.
The room above the others: it runs ``vit-ct predict`` as a process and imports only ``files`` and ``progress``."""
