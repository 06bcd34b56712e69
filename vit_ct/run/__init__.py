"""Running the model: commands, checkpoints, run folders.

The trainer and the machine (precision, threads), checkpoints and how a command follows one, run folders and their
summary, progress lines, W&B media, interrupts, ``vit-ct manifest`` (:mod:`~vit_ct.run.manifest_command`: the
manifest of a DICOM archive or a public set by name), and the one module that reaches into private library names
(:mod:`~vit_ct.run.compat`)."""
