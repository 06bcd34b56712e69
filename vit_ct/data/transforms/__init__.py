"""Tensor steps from HU to the model's input: HU windows, the slice grid <-> the model grid, the model input, the input
contract a checkpoint carries, and the training augmentations."""
