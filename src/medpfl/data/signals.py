"""Signal helpers shared by the FHBench time-series readers (PTB-XL, ADFTD).

Pure numpy; no file access. Each function names the rule it implements and its source; the
readers (:mod:`medpfl.data.ptbxl`, :mod:`medpfl.data.adftd`) cite them in their module rules.
"""

from __future__ import annotations

import numpy as np

STD_FLOOR = 1e-8  # a series with std <= this is treated as constant: centred only, scale 1


def standardise(x: np.ndarray, axis: int) -> np.ndarray:
    """z-score along ``axis`` (population std, ddof 0); same shape as ``x``, float64 for float64 in.

    A (near-)constant series, std <= :data:`STD_FLOOR` (in the units of ``x``), is only centred
    (scale 1), as sklearn's ``StandardScaler`` does for a zero scale and as the FHBench / Medformer
    ``normalize_batch_ts`` does for std == 0; without the floor a flat channel's rounding noise
    (~1e-15 after resampling) would be blown up to unit variance.
    """
    mean = x.mean(axis=axis, keepdims=True)
    std = x.std(axis=axis, keepdims=True)
    return (x - mean) / np.where(std > STD_FLOOR, std, 1.0)


def left_pad(x: np.ndarray, pad_to: int) -> np.ndarray:
    """Left zero-pad the last axis: ``[..., T]`` -> float32 ``[..., pad_to]``, data in the last T columns.

    FHBench's time-series loader pads each 1-s sample with zeros *before* the signal to MOMENT's
    input length 512 (``np.pad(x, ((pad, 0), (0, 0)))``, then transposes to channels-first).
    Raises ValueError if ``pad_to < T``.
    """
    t = x.shape[-1]
    if pad_to < t:
        raise ValueError(f"pad_to {pad_to} is shorter than a window ({t} samples)")
    out = np.zeros(x.shape[:-1] + (pad_to,), dtype=np.float32)
    out[..., pad_to - t:] = x
    return out


RESAMPLE_GRIDS = ("fhbench", "uniform")


def linear_resample(x: np.ndarray, fs_in: float, fs_out: float, grid: str = "fhbench") -> np.ndarray:
    """Linear-interpolation resampling along the last axis: ``[..., n]`` -> float64 ``[..., m]``.

    ``m = int(n / fs_in * fs_out)`` (the float expression of the FHBench / Medformer ADFTD
    preprocessing, so the rounding matches theirs). The output points, in input-sample units:

    - ``grid="fhbench"`` (default): ``np.linspace(0, n - 1, m)``, the first and last input samples
      kept and the m points evenly spread between them. This is what the FHBench code (and Medformer,
      from which it is taken) does: ``scipy.interpolate.interp1d(kind="linear")`` evaluated on
      ``np.linspace(1, n, m)`` over the sample positions ``np.linspace(1, n, n)``. The output step
      is ``(n - 1) / (m - 1)`` input samples, within a few ppm of ``fs_in / fs_out`` for minutes-long
      recordings (e.g. 1.9531312 vs 1.953125 for 10 min at 500 -> 256 Hz: 299,999 / 153,599).
    - ``grid="uniform"``: ``k * fs_in / fs_out`` for ``k < m`` (an exact ``fs_out`` grid from the first
      sample); offered as the literal reading of "linear resampling to 256 Hz".

    Values are ``np.interp`` of each series at those points (linear between the two neighbouring
    samples; no anti-aliasing filter, as in the source). ``x`` must have ``n >= 2`` on its last axis.
    """
    if grid not in RESAMPLE_GRIDS:
        raise ValueError(f"grid {grid!r} is not one of {RESAMPLE_GRIDS}")
    n = x.shape[-1]
    if n < 2:
        raise ValueError(f"linear_resample needs at least 2 samples, got {n}")
    m = int(n / fs_in * fs_out)
    if grid == "fhbench":
        t_new = np.linspace(0.0, n - 1.0, m)
    else:
        t_new = np.arange(m) * (fs_in / fs_out)
    t_old = np.arange(n, dtype=np.float64)
    flat = np.asarray(x, dtype=np.float64).reshape(-1, n)
    out = np.empty((flat.shape[0], m), dtype=np.float64)
    for i, row in enumerate(flat):
        out[i] = np.interp(t_new, t_old, row)
    return out.reshape(x.shape[:-1] + (m,))


def middle_window_starts(n: int, win: int) -> np.ndarray:
    """Starts of the non-overlapping ``win``-sample windows anchored at the middle of ``n`` samples.

    int64 ``[K]``, ascending. One window boundary lies at the middle sample ``c = n // 2``; windows
    are laid back from it towards the start and forward from it towards the end, as many whole
    windows as fit on each side: starts ``c - j * win`` for ``1 <= j <= c // win`` and ``c + j * win``
    for ``0 <= j < (n - c) // win``; ``K = c // win + (n - c) // win``. The leftover (< ``win``
    samples) at each end is dropped. Source: FHBench / Medformer ADFTD ``segment`` ("segmentation
    with no overlapping ... start from the middle position"), restated.
    """
    if win <= 0:
        raise ValueError(f"window length must be positive, got {win}")
    c = n // 2
    first = c - (c // win) * win
    stop = c + ((n - c) // win) * win
    return np.arange(first, stop, win, dtype=np.int64)
