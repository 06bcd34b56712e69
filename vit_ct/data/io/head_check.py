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
# A skull is not a closed ring in every slice: partial volume, noise, a suture or a burr hole open gaps of a pixel or
# a few mm, and one such gap would leave nothing enclosed. Gaps up to this share of the body's width are bridged
# (about 5 mm across a head), far narrower than a craniectomy, which stays flagged as outside the usual anatomy.
GAP_SHARE = 0.03
# Bridged gaps could close a rib cage too; what bone encloses in a chest is mostly lung (air), in a head brain.
ENCLOSED_AIR_SHARE = 0.25


def _disk(radius: int) -> np.ndarray:
    return np.hypot(*np.mgrid[-radius : radius + 1, -radius : radius + 1]) <= radius


def _enclosed(hu: np.ndarray) -> tuple[float, float]:
    """(share of the body's outline that bone encloses, share of that enclosed area that is air)."""
    body = hu > BODY_HU
    labels, count = ndimage.label(body)
    if count == 0:
        return 0.0, 0.0
    largest = labels == 1 + int(np.argmax(ndimage.sum(body, labels, range(1, count + 1))))
    outline = ndimage.binary_fill_holes(largest)  # the lungs of a chest are inside its outline
    bone = (hu > BONE_HU) & largest
    radius = max(1, round(GAP_SHARE * 2 * np.sqrt(outline.sum() / np.pi)))  # of the outline's equivalent diameter
    padded = np.pad(bone, radius + 1)  # so that bone at the image's edge closes as elsewhere
    bone = ndimage.binary_closing(padded, _disk(radius))[radius + 1 : -radius - 1, radius + 1 : -radius - 1]
    inside = ndimage.binary_fill_holes(bone) & ~bone & outline
    air = float((inside & ~body).sum() / inside.sum()) if inside.any() else 0.0
    return float(inside.sum() / outline.sum()), air


def enclosed_share(hu: np.ndarray) -> float:
    """The share of the largest body region's outline that bone encloses (bone excluded), gaps in the bone of up to
    :data:`GAP_SHARE` of the body's width bridged."""
    return _enclosed(hu)[0]


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
    share, air = _enclosed(hu)
    if share < ENCLOSED_SHARE:
        return f"no skull around the brain: bone encloses {share:.0%} of the body (a head slice: most of it)"
    if air > ENCLOSED_AIR_SHARE:
        return f"air fills {air:.0%} of what bone encloses (lungs? a head slice: brain)"
    return ""
