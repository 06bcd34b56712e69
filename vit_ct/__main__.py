"""``python -m vit_ct`` is the ``vit-ct`` command."""

from vit_ct.cli import main

if __name__ == "__main__":
    main()
