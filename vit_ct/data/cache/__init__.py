"""A manifest's derived files: the memory-mapped slice cache, its index, the pre-run check's record, and the folder that
holds them."""
