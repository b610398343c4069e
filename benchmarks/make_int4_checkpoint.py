"""An int4 checkpoint of the default model: the accuracy benchmark's int4 arms
(benchmarks/bench_quant_accuracy.py), since no AWQ / GPTQ checkpoint of SmolLM2-135M ships in a
package and AutoAWQ / AutoGPTQ need torch.

Every projection (q/k/v/o, gate/up/down) of the converted default model is quantized per output
row and group of `group` inputs (32 or 64: SmolLM2's 576 inputs do not split into groups of
128), asymmetric, W ~= s * (q - z) with s fp16 and q, z in 0..15, by one of two methods:
  - "rtn" (round to nearest): s = (max - min) / 15, z = round(-min / s), q = clamp(round(w / s)
    + z, 0, 15); stored in AutoAWQ's "gemm" packing (qweight [in, out / 8] int32, nibble j of
    word c holding output 8c + (0, 2, 4, 6, 1, 3, 5, 7)[j]; qzeros the same over groups; scales
    [in / g, out] fp16), served as quantization "awq".
  - "gptq": benchmarks/gptq.py's GPTQ against the Hessians of the projections' inputs over
    benchmarks/data/quant_calib_text.txt (a second original text, not the evaluation text),
    min/max groups; stored as a GPTQ v1 checkpoint without act order (qweight [in / 8,
    out], nibble j of word (r, o) = input 8r + j; qzeros [in / g, out / 8] holding z - 1;
    scales [in / g, out]; g_idx = i // g), served as quantization "gptq".
  - "gptq-act": the same with act order (desc_act): inputs quantized by decreasing Hessian
    diagonal, group j the j-th g of them, g_idx saying which (served sorted by group:
    runtime/quantization/hf_int4.py).
runtime/quantization/hf_int4.py's docstring has both formats. Norms and the (tied) embedding
stay float.

What it measures: the only weights of the default model on hand are its Q4_1 file's, already
4-bit (a float scale and a float minimum per 32 weights), and they are the "float" model here.
Rounding them again onto int4 with an INTEGER zero point moves every group's levels by up to
half a step, the same shift in every weight of a group, which RTN leaves in place
(benchmarks/RESULTS.md: +17% perplexity at groups of 64). GPTQ spreads each input's rounding
error over the inputs after it, as it does on any float checkpoint, so its arm is the int4
accuracy a GPTQ user gets -- of these particular weights.

    python benchmarks/make_int4_checkpoint.py OUT_DIR [--group 64] [--method rtn|gptq|gptq-act]
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gptq

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
CALIB_TEXT = Path(__file__).resolve().parent / "data" / "quant_calib_text.txt"
METHODS = ("rtn", "gptq", "gptq-act")
CALIB_CHUNK = 256  # tokens per calibration sequence
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def quantize_rtn(w: np.ndarray, group: int):
    """w [out, in] float32 -> (q uint8 [out, in], s float16 [out, in / g], z uint8 [out,
    in / g])."""
    out, k = w.shape
    blocks = w.reshape(out, k // group, group).astype(np.float32)
    lo, hi = blocks.min(axis=2), blocks.max(axis=2)
    s = np.maximum((hi - lo) / 15, np.float32(1e-8)).astype(np.float16)
    sf = s.astype(np.float32)
    z = np.clip(np.rint(-lo / sf), 0, 15).astype(np.uint8)
    q = np.clip(np.rint(blocks / sf[:, :, None]) + z[:, :, None], 0, 15).astype(np.uint8)
    return q.reshape(out, k), s, z


def pack_awq(values: np.ndarray) -> np.ndarray:
    """uint8 [rows, out] nibbles -> int32 [rows, out / 8] in AWQ's interleaved order."""
    rows, out = values.shape
    words = np.zeros((rows, out // 8), dtype=np.uint32)
    by_word = values.reshape(rows, out // 8, 8).astype(np.uint32)
    for j, col in enumerate(AWQ_ORDER):
        words |= by_word[:, :, col] << np.uint32(4 * j)
    return words.view(np.int32)


def pack_gptq(q: np.ndarray, s: np.ndarray, z: np.ndarray,
              perm: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """(q uint8 [out, in], s float16 [out, in / g], z uint8 [out, in / g]) -> the GPTQ v1
    tensors qweight, qzeros, scales, g_idx (module doc); perm: act order (group j holds inputs
    perm[j * g:(j + 1) * g], so g_idx[perm[j]] = j // g), None for groups in input order."""
    out, k = q.shape
    group = k // s.shape[1]
    g_idx = (np.arange(k) // group).astype(np.int32)
    if perm is not None:
        g_idx[perm] = np.arange(k) // group
    by_input = q.T.reshape(k // 8, 8, out).astype(np.uint32)          # [in / 8, 8, out]
    qweight = np.zeros((k // 8, out), dtype=np.uint32)
    for j in range(8):
        qweight |= by_input[:, j, :] << np.uint32(4 * j)
    stored = ((z.T.astype(np.int64) - 1) % 16).astype(np.uint32)      # v1: z - 1
    by_output = stored.reshape(k // group, out // 8, 8)
    qzeros = np.zeros((k // group, out // 8), dtype=np.uint32)
    for j in range(8):
        qzeros |= by_output[:, :, j] << np.uint32(4 * j)
    return {"qweight": qweight.view(np.int32), "qzeros": qzeros.view(np.int32),
            "scales": np.ascontiguousarray(s.T),
            "g_idx": g_idx}


def calibration_hessians(src: Path) -> dict[str, np.ndarray]:
    """benchmarks/gptq.py's Hessians of every projection's input over the calibration text,
    cut into CALIB_CHUNK-token sequences (the last, shorter one dropped)."""
    from gptq import collect_hessians

    from pagedrun.runtime.model_loader import load_model

    config, weights, tokenizer = load_model(str(src))
    ids = tokenizer.encode(CALIB_TEXT.read_text())
    chunks = [ids[i:i + CALIB_CHUNK] for i in range(0, len(ids) - CALIB_CHUNK + 1, CALIB_CHUNK)]
    return collect_hessians(config, weights, chunks, PROJECTIONS)


def make_checkpoint(out_dir: str | Path, group: int = 64, method: str = "rtn") -> Path:
    """Write the int4 checkpoint of the default model (method "rtn": AWQ packing; "gptq": GPTQ
    v1) into out_dir; returns it."""
    from safetensors import numpy as safetensors_numpy

    from pagedrun.runtime.model_loader import resolve_model_dir

    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    src = Path(resolve_model_dir(None, progress=False))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = safetensors_numpy.load_file(str(src / "model.safetensors"))
    hessians = calibration_hessians(src) if method != "rtn" else None
    packed = {}
    for name, value in tensors.items():
        base = name[:-len(".weight")] if name.endswith(".weight") else None
        if base is None or not base.endswith(PROJECTIONS):
            packed[name] = value
            continue
        w = np.asarray(value, np.float32)
        if method == "rtn":
            q, s, z = quantize_rtn(w, group)
            packed[base + ".qweight"] = pack_awq(np.ascontiguousarray(q.T))   # [in, out / 8]
            packed[base + ".qzeros"] = pack_awq(np.ascontiguousarray(z.T))    # [in / g, out / 8]
            packed[base + ".scales"] = np.ascontiguousarray(s.T)               # [in / g, out]
        else:
            from gptq import act_order, quantize_gptq

            perm = act_order(hessians[base]) if method == "gptq-act" else None
            q, s, z = quantize_gptq(w, hessians[base], group, perm=perm)
            for part, tensor in pack_gptq(q, s, z, perm).items():
                packed[f"{base}.{part}"] = tensor
    safetensors_numpy.save_file(packed, str(out / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    if method == "rtn":
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group,
                                         "zero_point": True, "version": "gemm"}
    else:
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group,
                                         "desc_act": method == "gptq-act", "sym": False,
                                         "checkpoint_format": "gptq"}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--method", choices=METHODS, default="rtn")
    args = ap.parse_args()
    print(make_checkpoint(args.out_dir, args.group, args.method))
