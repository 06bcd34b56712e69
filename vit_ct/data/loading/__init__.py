"""From a manifest to batches: datasets, the data modules, and how DDP deals slices to processes."""
