"""Running the model: commands, checkpoints, run folders.

The trainer and the machine (precision, threads), checkpoints and how a command follows one,
run folders and their summary, progress lines, W&B media, interrupts, and the one module that reaches into private
library names (:mod:`~vit_ct.run.compat`)."""
