"""``python -m vit_ct.review``: the review notebook, run headless (see :mod:`vit_ct.review.notebook`)."""

from vit_ct.review.notebook import main

if __name__ == "__main__":
    main()
