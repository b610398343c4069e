"""An int4 AWQ-format checkpoint of the default model, made by round-to-nearest (RTN): the
accuracy benchmark's int4 arm (benchmarks/bench_quant_accuracy.py), since no AWQ / GPTQ
checkpoint of SmolLM2-135M ships in a package and AutoAWQ needs torch.

Every projection (q/k/v/o, gate/up/down) of the converted default model is quantized per output
row and group of 64 inputs (SmolLM2's 576 inputs do not split into groups of 128), asymmetric:
s = (max - min) / 15 (fp16), z = round(-min / s) in 0..15, q = clamp(round(w / s) + z, 0, 15);
stored in AutoAWQ's "gemm" packing (qweight [in, out / 8] int32, nibble j of word c holding
output 8c + (0, 2, 4, 6, 1, 3, 5, 7)[j]; qzeros the same over groups; scales [in / 64, out]
fp16) -- runtime/hf_quantized.py's docstring has the format. Norms and the (tied) embedding
stay float.

What it measures: the only weights of the default model on hand are its Q4_1 file's, already
4-bit (a float scale and a float minimum per 32 weights). Rounding those again onto int4 with
an INTEGER zero point moves every group's levels by up to half a step, so this arm's loss
(benchmarks/RESULTS.md: +17% perplexity at groups of 64, +21% at 32) is that re-quantization's,
not what AWQ or GPTQ lose on a float checkpoint -- it exercises the int4 path end to end on a
real model, it does not measure int4's accuracy.

    python benchmarks/make_int4_checkpoint.py OUT_DIR [--group 64]
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
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


def make_checkpoint(out_dir: str | Path, group: int = 64) -> Path:
    """Write the RTN int4 checkpoint of the default model into out_dir; returns it."""
    from safetensors import numpy as safetensors_numpy

    from pagedrun.runtime.model_loader import resolve_model_dir

    src = Path(resolve_model_dir(None, progress=False))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = safetensors_numpy.load_file(str(src / "model.safetensors"))
    packed = {}
    for name, value in tensors.items():
        base = name[:-len(".weight")] if name.endswith(".weight") else None
        if base is None or not base.endswith(PROJECTIONS):
            packed[name] = value
            continue
        q, s, z = quantize_rtn(np.asarray(value, np.float32), group)
        packed[base + ".qweight"] = pack_awq(np.ascontiguousarray(q.T))   # [in, out / 8]
        packed[base + ".qzeros"] = pack_awq(np.ascontiguousarray(z.T))    # [in / g, out / 8]
        packed[base + ".scales"] = np.ascontiguousarray(s.T)               # [in / g, out]
    safetensors_numpy.save_file(packed, str(out / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group,
                                     "zero_point": True, "version": "gemm"}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--group", type=int, default=64)
    args = ap.parse_args()
    print(make_checkpoint(args.out_dir, args.group))
