"""Whether a slice looks like what vit-ct's models read: an axial head CT through the skull. A slice of another body
part (a vertebra, a chest) gets a probability all the same; this says so instead of letting it pass silently, from
the DICOM header where it names the body part and from the pixels (the skull's ring around the brain) where not.
"""

from __future__ import annotations

import os

import numpy as np
from scipy import ndimage

# Body parts (DICOM BodyPartExamined, upper case) a head CT is filed under; any other named part is not a head.
HEAD_PARTS = frozenset({"HEAD", "BRAIN", "SKULL", "HEADNECK", "HEAD_NECK", "HEAD NECK", "CEREBRUM", "NEUROCRANIUM"})
BODY_HU, BONE_HU = -300.0, 300.0  # above air and fat / above soft tissue and blood: the body, and bone
# A head slice at brain level: the skull encloses most of the head's cross-section; at a vertebra the bone encloses
# only the spinal canal. Below this share of the body enclosed by bone a slice is flagged (the skull base and the
# vertex enclose less than the mid-brain, so the bound is set well below a head's).
ENCLOSED_SHARE = 0.2


def enclosed_share(hu: np.ndarray) -> float:
    """The share of the largest body region's pixels that bone encloses (holes of the bone mask, bone excluded)."""
    body = hu > BODY_HU
    labels, count = ndimage.label(body)
    if count == 0:
        return 0.0
    largest = labels == 1 + int(np.argmax(ndimage.sum(body, labels, range(1, count + 1))))
    bone = (hu > BONE_HU) & largest
    inside = ndimage.binary_fill_holes(bone) & ~bone
    return float(inside.sum() / largest.sum())


def body_part(path: str | os.PathLike) -> str | None:
    """A DICOM file's BodyPartExamined (upper case), None where it names none or the file is not DICOM."""
    import pydicom

    try:
        dataset = pydicom.dcmread(path, stop_before_pixels=True, specific_tags=["BodyPartExamined"])
    except Exception:  # NIfTI, .npy: no header to read
        return None
    part = str(dataset.get("BodyPartExamined", "") or "").strip().upper()
    return part or None


def head_check(path: str | os.PathLike, hu: np.ndarray) -> str:
    """Why the slice at ``path`` (its HU ``hu``) does not look like an axial head CT, or "" where it does."""
    part = body_part(path)
    if part is not None and part not in HEAD_PARTS:
        return f"not a head: BodyPartExamined is {part}"
    share = enclosed_share(hu)
    if share < ENCLOSED_SHARE:
        return f"no skull around the brain: bone encloses {share:.0%} of the body (a head slice: most of it)"
    return ""
