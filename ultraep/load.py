"""Validation of the load matrix ``λ[R, E]`` (token–expert assignments per source rank and expert)."""

from __future__ import annotations

import numpy as np

from ultraep.errors import LoadError


def validate_load(load, num_ranks: int | None = None, num_experts: int | None = None, path: str = "load") -> np.ndarray:
    """Return ``load`` as a C-contiguous int64 ``[R, E]`` array, or raise :class:`LoadError`.

    Accepts any array-like of non-negative integers (integral floats such as ``3.0`` are accepted; ``3.5``,
    NaN, inf, negatives, booleans and wrong shapes are not). An all-zero load is valid: every policy
    returns the identity plan for it.
    """
    if type(load) is np.ndarray and load.dtype == np.int64 and load.ndim == 2 and load.flags.c_contiguous:
        # Hot path (the runtime and plan_layer pass exactly this): one pass for the sign check.
        R, E = load.shape
        if (num_ranks is None or R == num_ranks) and (num_experts is None or E == num_experts) and R and E:
            if load.min() >= 0:
                return load
    try:
        arr = np.asarray(load)
    except Exception as exc:  # ragged lists and the like
        raise LoadError(path, f"is not an array of counts ({exc})") from None
    if arr.dtype == object or arr.dtype.kind not in "biuf":
        raise LoadError(path, f"must hold integer token counts, got dtype {arr.dtype}", str(arr.dtype))
    if arr.dtype.kind == "b":
        raise LoadError(path, "must hold integer token counts, got booleans", "bool")
    if arr.ndim != 2:
        raise LoadError(path, f"must be a 2-D [ranks, experts] matrix, got shape {arr.shape}", arr.shape)
    if num_ranks is not None and arr.shape[0] != num_ranks:
        raise LoadError(path, f"has {arr.shape[0]} rows but the EP group has {num_ranks} ranks", arr.shape)
    if num_experts is not None and arr.shape[1] != num_experts:
        raise LoadError(path, f"has {arr.shape[1]} columns but the layer has {num_experts} experts", arr.shape)
    if arr.shape[0] == 0 or arr.shape[1] == 0:
        raise LoadError(path, f"is empty (shape {arr.shape})", arr.shape)
    if arr.dtype.kind == "f":
        bad = ~np.isfinite(arr)
        if bad.any():
            idx = tuple(int(i) for i in np.argwhere(bad)[0])
            raise LoadError(f"{path}[{idx[0]}, {idx[1]}]", f"is not finite ({arr[idx]})", float(arr[idx]))
        frac = arr != np.round(arr)
        if frac.any():
            idx = tuple(int(i) for i in np.argwhere(frac)[0])
            raise LoadError(
                f"{path}[{idx[0]}, {idx[1]}]", f"is not a whole number of tokens ({arr[idx]})", float(arr[idx])
            )
    neg = arr < 0
    if neg.any():
        idx = tuple(int(i) for i in np.argwhere(neg)[0])
        raise LoadError(f"{path}[{idx[0]}, {idx[1]}]", f"is negative ({arr[idx]})", arr[idx].item())
    if arr.dtype.kind == "u" and arr.dtype.itemsize >= 8 and arr.max() > np.iinfo(np.int64).max:
        raise LoadError(path, "holds counts beyond int64", int(arr.max()))
    if arr.dtype == np.int64 and arr.flags.c_contiguous:
        return arr
    return np.ascontiguousarray(arr, dtype=np.int64)
