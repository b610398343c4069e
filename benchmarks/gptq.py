"""GPTQ in numpy: int4 weights chosen against the layer inputs' second moments, the way AutoGPTQ
quantizes a float checkpoint (Frantar et al., "GPTQ", 2022), for the accuracy benchmark's int4
arm (benchmarks/make_int4_checkpoint.py --method gptq). A tool, not the runtime: it runs once
when the checkpoint is made.

    hessians = collect_hessians(config, weights, token_chunks)   # {HF projection name: H}
    q, s, z = quantize_gptq(w, hessians[name], group)              # as quantize_rtn's

For one projection y = W x (W [out, in]), H = (2 / n) sum over the calibration tokens of x x^T
([in, in], float64). The inputs are quantized one at a time in order (act order off: groups of
`group` consecutive inputs, as AWQ and GPTQ v1 checkpoints without desc_act store them); the
rounding error of input i, divided by [H^-1]_ii, is spread over the inputs not yet quantized
along row i of the upper Cholesky factor U of H^-1 (H^-1 = U^T U), which is what keeps W x
close to the float result on inputs like the calibration ones. Columns are handled in blocks of
128 whose errors reach the later columns as one GEMM. A group's scale and zero are fixed when
its first input is reached, from the group's weights as updated so far (min/max, or the
clip-search variant `mse=True`: the min/max shrunk by the factor of least |error|^2.4 among
1.00, 0.99, ..., 0.80, per output row). H gets 1% of its mean diagonal added ("damp"); an input
the calibration never excited (H_ii = 0) gets weight 0.

The Hessians come from the float32 reference forward (runtime/reference.py) over the calibration
chunks, every projection's input recorded as the float model computes it (not the sequential
variant that feeds each layer the already-quantized layers' outputs).
"""
from __future__ import annotations

import numpy as np

BLOCK = 128
CLIP_SHRINK = np.linspace(1.0, 0.8, 21)
CLIP_NORM = 2.4


class _InputRecorder(np.ndarray):
    """A weight matrix that hands every left operand of `x @ W.T` to `sink(name, x)`."""

    def __array_finalize__(self, obj) -> None:
        self.name = getattr(obj, "name", None)
        self.sink = getattr(obj, "sink", None)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        plain = tuple(np.asarray(a) if isinstance(a, _InputRecorder) else a for a in inputs)
        if (ufunc is np.matmul and method == "__call__" and len(inputs) == 2
                and isinstance(inputs[1], _InputRecorder)):
            inputs[1].sink(inputs[1].name, plain[0])
        return getattr(ufunc, method)(*plain, **kwargs)


def collect_hessians(config, weights, token_chunks, projections) -> dict[str, np.ndarray]:
    """{"model.layers.N.<projection>": H [in, in] float64} over the token chunks (each a list of
    ids, run as its own sequence through the float32 reference forward). `projections`: the
    LayerWeights attribute suffixes to record, e.g. ("self_attn.q_proj", "mlp.down_proj")."""
    from pagedrun.runtime.reference import ReferenceModel

    sums: dict[str, np.ndarray] = {}
    counts: dict[str, int] = {}

    def sink(name: str, x: np.ndarray) -> None:
        x64 = x.reshape(-1, x.shape[-1]).astype(np.float64)
        sums[name] = sums.get(name, 0) + x64.T @ x64
        counts[name] = counts.get(name, 0) + x64.shape[0]

    originals = []
    for index, layer in enumerate(weights.layers):
        for projection in projections:
            attr = projection.split(".")[-1]
            matrix = getattr(layer, attr)
            recorder = matrix.view(_InputRecorder)
            recorder.name, recorder.sink = f"model.layers.{index}.{projection}", sink
            originals.append((layer, attr, matrix))
            setattr(layer, attr, recorder)
    try:
        model = ReferenceModel(config, weights)
        for chunk in token_chunks:
            model.hidden_states(np.asarray(chunk, dtype=np.int64))
    finally:
        for layer, attr, matrix in originals:
            setattr(layer, attr, matrix)
    return {name: (2.0 / counts[name]) * h for name, h in sums.items()}


def _group_params(seg: np.ndarray, mse: bool) -> tuple[np.ndarray, np.ndarray]:
    """seg [out, g] -> (s fp16-exact float64 [out], z float64 [out] in 0..15), asymmetric."""
    lo = np.minimum(seg.min(axis=1), 0.0)
    hi = np.maximum(seg.max(axis=1), 0.0)
    shrinks = CLIP_SHRINK if mse else CLIP_SHRINK[:1]
    best_s = best_z = best_err = None
    for p in shrinks:
        s = np.maximum((hi - lo) * p / 15, 1e-8).astype(np.float16).astype(np.float64)
        z = np.clip(np.rint(-lo * p / s), 0, 15)
        q = np.clip(np.rint(seg / s[:, None]) + z[:, None], 0, 15)
        err = (np.abs(s[:, None] * (q - z[:, None]) - seg) ** CLIP_NORM).sum(axis=1)
        if best_err is None:
            best_s, best_z, best_err = s, z, err
        else:
            better = err < best_err
            best_s = np.where(better, s, best_s)
            best_z = np.where(better, z, best_z)
            best_err = np.where(better, err, best_err)
    return best_s, best_z


def act_order(hessian: np.ndarray) -> np.ndarray:
    """GPTQ's act order (desc_act): the inputs by decreasing H_ii (stable), int64 [in]."""
    return np.argsort(-np.diag(hessian), kind="stable").astype(np.int64)


def quantize_gptq(w: np.ndarray, hessian: np.ndarray, group: int, damp: float = 0.01,
                  mse: bool = False, perm: np.ndarray | None = None):
    """w [out, in] float, hessian [in, in] -> (q uint8 [out, in], s float16 [out, in / g],
    z uint8 [out, in / g]) with W ~= s * (q - z) per group (module doc).

    perm (act order, e.g. act_order(hessian)): the inputs are quantized in the order perm, and
    group j holds inputs perm[j * g:(j + 1) * g]; q comes back in the inputs' own order, so
    W[:, i] ~= s[:, g_idx[i]] * (q[:, i] - z[:, g_idx[i]]) with g_idx[perm[j]] = j // g."""
    if perm is not None:
        q, s, z = quantize_gptq(np.asarray(w)[:, perm], np.asarray(hessian)[np.ix_(perm, perm)],
                                group, damp, mse)
        inverse = np.empty_like(perm)
        inverse[perm] = np.arange(perm.size)
        return q[:, inverse], s, z
    W = np.array(w, dtype=np.float64)
    out, k = W.shape
    if k % group or BLOCK % group:
        raise ValueError(f"in_features {k} and the block {BLOCK} must be multiples of {group}")
    H = np.array(hessian, dtype=np.float64)
    dead = np.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H[np.diag_indices(k)] += damp * np.mean(np.diag(H))
    U = np.linalg.cholesky(np.linalg.inv(H)).T          # H^-1 = U^T U, U upper
    q_all = np.zeros((out, k), dtype=np.uint8)
    s_all = np.zeros((out, k // group), dtype=np.float16)
    z_all = np.zeros((out, k // group), dtype=np.uint8)
    for i1 in range(0, k, BLOCK):
        i2 = min(i1 + BLOCK, k)
        block = W[:, i1:i2].copy()
        errors = np.zeros_like(block)
        u = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % group == 0:
                s, z = _group_params(block[:, i:i + group], mse)
                s_all[:, col // group], z_all[:, col // group] = s, z
            q = np.clip(np.rint(block[:, i] / s) + z, 0, 15)
            q_all[:, col] = q
            err = (block[:, i] - s * (q - z)) / u[i, i]
            block[:, i:] -= np.outer(err, u[i, i:])
            errors[:, i] = err
        W[:, i2:] -= errors @ U[i1:i2, i2:]
    return q_all, s_all, z_all
