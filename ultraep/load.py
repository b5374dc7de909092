"""Validation of the load matrix ``λ[R, E]`` (token–expert assignments per source rank and expert)."""

from __future__ import annotations

import numpy as np

from ultraep.errors import LoadError

#: Largest total load of one expert (``λ_e``, summed over source ranks) a plan accepts: the exact integer
#: token splits multiply two such counts in int64 (2^62 < 2^63). Real layers carry well under 2^28.
MAX_EXPERT_LOAD = 2**31 - 1


def validate_load(load, num_ranks: int | None = None, num_experts: int | None = None, path: str = "load") -> np.ndarray:
    """Return ``load`` as a C-contiguous int64 ``[R, E]`` array, or raise :class:`LoadError`.

    Accepts any array-like of non-negative integers (integral floats such as ``3.0`` are accepted; ``3.5``,
    NaN, inf, negatives, booleans and wrong shapes are not). An all-zero load is valid: every policy
    returns the identity plan for it. Each expert's total over the sources (``λ_e``) must be at most
    :data:`MAX_EXPERT_LOAD`: the planners' exact integer token splits multiply two such counts in int64.
    """
    if type(load) is np.ndarray and load.dtype == np.int64 and load.ndim == 2 and load.flags.c_contiguous:
        # Hot path (the runtime and plan_layer pass exactly this): two passes, sign and magnitude.
        R, E = load.shape
        if (num_ranks is None or R == num_ranks) and (num_experts is None or E == num_experts) and R and E:
            if load.min() >= 0 and int(load.max()) * R <= MAX_EXPERT_LOAD:  # bounds every λ_e, no column sums
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
    if arr.max() > MAX_EXPERT_LOAD:
        idx = tuple(int(i) for i in np.unravel_index(int(np.argmax(arr)), arr.shape))
        raise LoadError(f"{path}[{idx[0]}, {idx[1]}]", f"({arr[idx]}) exceeds {MAX_EXPERT_LOAD} (2^31 - 1) "
                        "token-expert assignments", arr[idx].item())
    col = arr.sum(axis=0, dtype=np.int64)  # entries < 2^31: no wrap-around for fewer than 2^32 ranks
    if col.max() > MAX_EXPERT_LOAD:
        e = int(np.argmax(col))
        raise LoadError(f"{path}[:, {e}]", f"expert {e}'s total load ({col[e]}) exceeds {MAX_EXPERT_LOAD} (2^31 - 1) "
                        "token-expert assignments (the planners split tokens exactly in int64)", int(col[e]))
    if arr.dtype == np.int64 and arr.flags.c_contiguous:
        return arr
    return np.ascontiguousarray(arr, dtype=np.int64)
