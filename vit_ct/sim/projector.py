"""Parallel-beam Radon transform and filtered back-projection in torch, reconstruction kernels smooth to sharp.

Follows Kak & Slaney, "Principles of Computerized Tomographic Imaging" (1988), chapter 3, with the geometry
of `skimage.transform.radon` / `iradon` (circle=True) so the two agree sample for sample on odd-sized grids.
"""

# Written here rather than calling skimage's radon/iradon, which work one slice at a time and far slower. Two ways
# to compute the same samples: "sampled" interpolates every ray sample with grid_sample (any angles, nothing to set
# up); "matrix" sums those very samples once into sparse system matrices (seconds and about a hundred MB to set up
# per geometry) and then projects a batch as one sparse x dense product, faster in batches and slower for one slice
# (benchmarks/simulator_throughput.py measures both: benchmarks/records/simulator_throughput.json).

import math
import warnings
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

FILTER_NAMES = ("ramp", "shepp-logan", "cosine", "hamming", "hann")
METHODS = ("sampled", "matrix")


@dataclass(frozen=True)
class Kernel:
    """A reconstruction kernel of continuous sharpness: the ramp filter apodised by a Gaussian whose response halves
    at `half_response` (fraction of the Nyquist frequency), times `1 + edge_boost * (f / Nyquist)^2`, the mid- and
    high-frequency lift of edge-enhancing (bone) kernels. A higher `half_response` or `edge_boost` is sharper: more
    noise, steeper edges. ~0.45 is a smooth soft-tissue kernel, ~0.6 the "hann" window, ~1 close to the plain ramp.
    """

    half_response: float = 0.6
    edge_boost: float = 0.0

    def __post_init__(self):
        if not 0.05 <= self.half_response <= 5 or not 0 <= self.edge_boost <= 10:
            raise ValueError(
                f"Kernel needs half_response in [0.05, 5] and edge_boost in [0, 10], got {self.half_response}, "
                f"{self.edge_boost}"
            )

    @property
    def name(self) -> str:
        """Short name for DICOM ConvolutionKernel (at most 16 characters) and manifests."""
        return f"G{self.half_response:.2f}B{self.edge_boost:.2f}"


def default_angles(n_angles: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """`n_angles` projection angles in radians, evenly spaced over [0, pi)."""
    return torch.arange(n_angles, dtype=torch.float64, device=device) * (math.pi / n_angles)


def _centre(n: int) -> float:
    # Rotation axis at the geometric centre of the grid; equals skimage's `n // 2` when n is odd.
    return (n - 1) / 2


def _ray_positions(angles: tuple[float, ...], size: int, n_det: int, step_px: float) -> tuple[torch.Tensor, ...]:
    """Ray samples `step_px` apart: x (right) and y (up) in pixels from the centre, float64 `(A, n_det, S)` each."""
    t = (torch.arange(n_det, dtype=torch.float64) - _centre(n_det))[None, :, None]  # detector offset, pixels
    n_steps = math.floor(2 * _centre(size) / step_px) + 1
    s = (torch.arange(n_steps, dtype=torch.float64) * step_px - (n_steps - 1) * step_px / 2)[None, None, :]
    theta = torch.tensor(angles, dtype=torch.float64)[:, None, None]
    return t * theta.cos() - s * theta.sin(), t * theta.sin() + s * theta.cos()


@lru_cache(maxsize=16)
def _projection_geometry(angles: tuple[float, ...], size: int, n_det: int, step_px: float, device: str) -> torch.Tensor:
    """Ray samples as `(A, n_det, S, 2)` positions for `grid_sample` (align_corners=True).

    Each ray's S samples are contiguous, so summing them reads memory in order.
    """
    c = _centre(size)
    x, y = _ray_positions(angles, size, n_det, step_px)
    return torch.stack([x / c, -y / c], dim=-1).float().to(device)  # rows run downwards


@lru_cache(maxsize=16)
def scan_circle(size: int, device: str) -> torch.Tensor:
    """Bool `(size, size)`, True inside the reconstruction circle (skimage's: radius size // 2)."""
    offsets = torch.arange(size, dtype=torch.float64) - _centre(size)
    return (offsets[:, None] ** 2 + offsets[None, :] ** 2 <= (size // 2) ** 2).to(device)


def _detector_positions(angles: tuple[float, ...], size: int, n_det: int) -> torch.Tensor:
    """Detector index (fractional) of every pixel inside the scan circle for every angle, float64 `(A, P)`."""
    offsets = torch.arange(size, dtype=torch.float64) - _centre(size)
    y, x = torch.meshgrid(-offsets, offsets, indexing="ij")  # pixels, y up
    inside = scan_circle(size, "cpu")
    theta = torch.tensor(angles, dtype=torch.float64)[:, None]
    return x[inside] * theta.cos() + y[inside] * theta.sin() + _centre(n_det)


@lru_cache(maxsize=16)
def _backprojection_geometry(angles: tuple[float, ...], size: int, n_det: int, device: str):
    """Detector position of every pixel inside the scan circle for every angle.

    Returns:
        grid: `(A, 1, P, 2)` positions on the `(A, 1, n_det)` filtered sinogram for `grid_sample`.
        inside: bool `(size, size)` reconstruction circle (P pixels).
    """
    gx = _detector_positions(angles, size, n_det) / (n_det - 1) * 2 - 1
    grid = torch.stack([gx, torch.zeros_like(gx)], dim=-1)[:, None].float().to(device)
    return grid, scan_circle(size, device)


class _SparseRows:
    """A sparse matrix in CSR arrays (int32 indices: MKL's fast path, faster than int64 here) whose row blocks
    multiply dense matrices."""

    def __init__(self, crow: np.ndarray, col: np.ndarray, value: np.ndarray, n_cols: int, device: str):
        self.crow = torch.from_numpy(crow.astype(np.int32)).to(device)
        self.col = torch.from_numpy(col.astype(np.int32)).to(device)
        self.value = torch.from_numpy(value.astype(np.float32)).to(device)
        self.n_rows, self.n_cols = len(crow) - 1, n_cols

    def matmul(self, dense: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
        """`M[rows] @ dense`: `(R, n_cols) @ (n_cols, B)`, float32."""
        start, stop, _ = rows.indices(self.n_rows)
        first, last = int(self.crow[start]), int(self.crow[stop])
        with warnings.catch_warnings():  # torch calls its CSR support beta, once per process
            warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta", UserWarning)
            block = torch.sparse_csr_tensor(
                self.crow[start : stop + 1] - first,
                self.col[first:last],
                self.value[first:last],
                (stop - start, self.n_cols),
                check_invariants=False,
            )
        return block @ dense


# The matrices are built in numpy: the loop of small array operations ran several times slower as torch ops on 2
# threads of a busy 2-core machine, and numpy's run on one thread whatever torch is set to.


def _bilinear_taps(ix: np.ndarray, iy: np.ndarray, size: int):
    """grid_sample's bilinear taps (zeros padding) at column `ix`, row `iy`: flat pixel index and weight, 4 each."""
    x0, y0 = np.floor(ix), np.floor(iy)
    fx, fy = ix - x0, iy - y0
    for dx, dy in ((0, 0), (1, 0), (0, 1), (1, 1)):
        col, row = x0 + dx, y0 + dy
        weight = (fx if dx else 1 - fx) * (fy if dy else 1 - fy)
        valid = (col >= 0) & (col < size) & (row >= 0) & (row < size) & (weight > 0)
        yield (row * size + col).astype(np.int64), weight, valid


@lru_cache(maxsize=4)
def _projection_matrix(angles: tuple[float, ...], size: int, n_det: int, step_px: float, device: str) -> _SparseRows:
    """`(A * n_det, size * size)` sums of the bilinear weights of every ray's samples: the "sampled" projection as
    one matrix (rows angle-major, then detector bin); pixels outside the scan circle have no column entries."""
    c = _centre(size)
    inside = scan_circle(size, "cpu").flatten().numpy()
    xs, ys = (positions.numpy() for positions in _ray_positions(angles, size, n_det, step_px))
    ray = np.broadcast_to(np.arange(n_det)[:, None], xs.shape[1:])
    counts, cols, values = [], [], []
    for x, y in zip(xs, ys, strict=True):  # one angle: (n_det, S) each
        keys, weights = [], []
        for pixel, weight, valid in _bilinear_taps(x + c, c - y, size):
            valid &= inside[np.clip(pixel, 0, size * size - 1)]
            keys.append((ray * (size * size) + pixel)[valid])
            weights.append(weight[valid])
        unique, inverse = np.unique(np.concatenate(keys), return_inverse=True)  # sorted by ray, then pixel
        counts.append(np.bincount(unique // (size * size), minlength=n_det))
        cols.append(unique % (size * size))
        values.append(np.bincount(inverse, weights=np.concatenate(weights)))
    crow = np.concatenate([[0], np.cumsum(np.concatenate(counts))])
    return _SparseRows(crow, np.concatenate(cols), np.concatenate(values), size * size, device)


@lru_cache(maxsize=4)
def _backprojection_matrix(angles: tuple[float, ...], size: int, n_det: int, device: str) -> _SparseRows:
    """`(P, A * n_det)` linear-interpolation weights of every pixel inside the scan circle on every view's detector:
    the "sampled" back-projection as one matrix. Each row's entries are already in column order, no sorting."""
    u = _detector_positions(angles, size, n_det).numpy().T  # (P, A)
    u0 = np.floor(u)
    taps = np.stack([u0, u0 + 1], axis=-1)  # (P, A, 2) detector bins
    weight = np.stack([1 - (u - u0), u - u0], axis=-1)
    valid = (taps >= 0) & (taps <= n_det - 1) & (weight > 0)
    col = taps + (np.arange(len(angles)) * n_det)[None, :, None]
    crow = np.concatenate([[0], np.cumsum(valid.reshape(len(u), -1).sum(1))])
    return _SparseRows(crow, col[valid].astype(np.int64), weight[valid], len(angles) * n_det, device)


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")


def forward_project(
    mu: torch.Tensor,
    angles: torch.Tensor,
    *,
    pixel_spacing_mm: float = 1.0,
    n_det: int | None = None,
    step_px: float = 1.0,
    method: str = "sampled",
) -> torch.Tensor:
    """Parallel-beam Radon transform: line integrals through a batch of attenuation maps.

    Only the circle inscribed in the grid is projected (like skimage `radon(circle=True)`): values outside it
    are treated as zero, the scanner never sees the corners.

    Args:
        mu: linear attenuation `(B, H, W)` with H == W, in 1/mm (or any per-pixel quantity); or `(B, K, H, W)`, K
            frames of a moving object: the views split into K consecutive groups, group k seeing frame k.
        angles: projection angles in radians, `(A,)`; A divisible by K.
        pixel_spacing_mm: pixel size; line integrals are sums of samples one pixel apart times this.
        n_det: detector bins, one pixel wide; defaults to W.
        step_px: spacing of the samples along each ray, pixels; up to ~2 is accurate for images blurred by a
            Gaussian of sigma >= 0.8 pixel (the sum is exact below 1 / step_px cycles per pixel).
        method: "sampled" (grid_sample per call) or "matrix" (the same samples as a cached sparse matrix; faster
            for batches, equal to ~1e-6 relative).

    Returns:
        Sinogram `(B, A, n_det)` of line integrals (dimensionless when `mu` is in 1/mm).
    """
    if mu.ndim not in (3, 4) or mu.shape[-1] != mu.shape[-2]:
        raise ValueError(f"mu must be a square batch (B, H, W) or (B, K, H, W), got shape {tuple(mu.shape)}")
    _check_method(method)
    frames = mu[:, None] if mu.ndim == 3 else mu
    B, K, H, _ = frames.shape
    A, n_det = len(angles), n_det or H
    if A % K:
        raise ValueError(f"{A} angles do not split into {K} equal groups of views, one per frame")
    key = (tuple(angles.tolist()), H, n_det, step_px, str(mu.device))
    groups = [slice(k * A // K, (k + 1) * A // K) for k in range(K)]
    if method == "matrix":
        matrix = _projection_matrix(*key)
        dense = frames.float().reshape(B, K, H * H).permute(1, 2, 0).contiguous()  # (K, H * W, B)
        sums = [matrix.matmul(dense[k], slice(g.start * n_det, g.stop * n_det)) for k, g in enumerate(groups)]
        sinogram = torch.cat(sums).reshape(A, n_det, B)
        return (sinogram * (step_px * pixel_spacing_mm)).permute(2, 0, 1)  # (B, A, n_det)
    grid = _projection_geometry(*key)
    frames = frames.float() * scan_circle(H, str(mu.device))
    # Batch elements become channels so all of them share one sampling grid (expand does not copy); angles go in
    # chunks of ~4M samples to stay in cache. Summing a rectangle of samples beats gathering only those inside
    # the circle (tried: segment sums cost more than the samples outside it that they save).
    sums = [
        F.grid_sample(frames[None, :, k].expand(len(chunk), B, H, H), chunk, align_corners=True).sum(-1)  # (a, B, W)
        for k, group in enumerate(groups)
        for chunk in torch.split(grid[group], _chunk(len(grid[group]), B * n_det * grid.shape[2]))
    ]
    return (torch.cat(sums) * (step_px * pixel_spacing_mm)).permute(1, 0, 2)  # (B, A, n_det)


def _chunk(n_angles: int, per_angle: int) -> int:
    """Angles per grid_sample call: ~4M samples at a time keeps the intermediate small (measured fastest)."""
    return max(1, min(n_angles, 2**22 // per_angle))


def fourier_filter(size: int, filter_name: str | Kernel) -> torch.Tensor:
    """Ramp filter with an optional apodisation window, `(size,)` in FFT order.

    Built from the band-limited spatial ramp (Kak & Slaney eq. 61) to avoid the DC bias of a sampled |f|.
    Sharper to smoother: "ramp", "shepp-logan", "cosine", "hamming", "hann" (the reconstruction kernel), or a
    `Kernel` of continuous sharpness.
    """
    if not isinstance(filter_name, Kernel) and filter_name not in FILTER_NAMES:
        raise ValueError(f"filter_name must be one of {FILTER_NAMES} or a Kernel, got {filter_name!r}")
    n = np.concatenate((np.arange(1, size / 2 + 1, 2, dtype=int), np.arange(size / 2 - 1, 0, -2, dtype=int)))
    f = np.zeros(size)
    f[0] = 0.25
    f[1::2] = -1 / (np.pi * n) ** 2
    ramp = 2 * np.real(np.fft.fft(f))
    if isinstance(filter_name, Kernel):
        nyquist = np.abs(np.fft.fftfreq(size)) / 0.5  # fraction of Nyquist, exactly even in FFT order
        apodisation = np.exp(-math.log(2) * (nyquist / filter_name.half_response) ** 2)
        ramp *= apodisation * (1 + filter_name.edge_boost * nyquist**2)
    elif filter_name == "shepp-logan":
        omega = np.pi * np.fft.fftfreq(size)[1:]
        ramp[1:] *= np.sin(omega) / omega
    elif filter_name == "cosine":
        ramp *= np.fft.fftshift(np.sin(np.linspace(0, np.pi, size, endpoint=False)))
    elif filter_name == "hamming":
        ramp *= np.fft.fftshift(np.hamming(size))
    elif filter_name == "hann":
        ramp *= np.fft.fftshift(np.hanning(size))
    return torch.from_numpy(ramp)


def filtered_back_projection(
    sinogram: torch.Tensor,
    angles: torch.Tensor,
    *,
    filter_name: str | Kernel | list[str | Kernel] = "ramp",
    pixel_spacing_mm: float = 1.0,
    size: int | None = None,
    method: str = "sampled",
) -> torch.Tensor:
    """Filtered back-projection of parallel-beam line integrals.

    Args:
        sinogram: `(B, A, n_det)` line integrals, as from `forward_project`.
        angles: projection angles in radians, `(A,)`, evenly covering [0, pi).
        filter_name: reconstruction kernel (see `fourier_filter`), one for the batch or one per element.
        pixel_spacing_mm: output pixel size; turns line integrals back into values per mm.
        size: output rows and columns; defaults to n_det.
        method: "sampled" (grid_sample per call) or "matrix" (cached sparse matrix; faster for batches).

    Returns:
        Image `(B, size, size)`, zero outside the reconstruction circle.
    """
    _check_method(method)
    B, A, n_det = sinogram.shape
    size = size or n_det
    padded = max(64, 2 ** math.ceil(math.log2(2 * n_det)))
    names = [filter_name] * B if isinstance(filter_name, (str, Kernel)) else list(filter_name)
    if len(names) != B:
        raise ValueError(f"filter_name gives {len(names)} kernels for a batch of {B}")
    distinct = list(dict.fromkeys(names))
    filters = torch.stack([fourier_filter(padded, name) for name in distinct]).to(sinogram.device)
    kernel = filters[[distinct.index(name) for name in names]][:, None]  # (B, 1, padded)
    # Full complex FFT and the real part, as skimage does: the windowed filters are not exactly even.
    spectrum = torch.fft.fft(sinogram.double(), n=padded, dim=-1) * kernel
    filtered = torch.fft.ifft(spectrum, dim=-1).real[..., :n_det].float()  # (B, A, n_det)

    key = (tuple(angles.tolist()), size, n_det, str(sinogram.device))
    image = filtered.new_zeros(B, size, size)  # float32
    inside = scan_circle(size, str(sinogram.device))
    if method == "matrix":
        total = _backprojection_matrix(*key).matmul(filtered.reshape(B, A * n_det).T.contiguous()).T  # (B, P)
    else:
        grid, _ = _backprojection_geometry(*key)
        # Angles become the batch of grid_sample and images its channels: one 1-D interpolation per pixel and angle.
        by_angle = filtered.permute(1, 0, 2)[:, :, None]  # (A, B, 1, n_det)
        step = _chunk(A, B * grid.shape[2])
        total = sum(
            F.grid_sample(by_angle[i : i + step], grid[i : i + step], align_corners=True)[:, :, 0].sum(0)  # (B, P)
            for i in range(0, A, step)
        )
    image[:, inside] = total * (math.pi / (2 * A) / pixel_spacing_mm)
    return image
