#!/usr/bin/env python3
"""Generates crates/engine/testdata/quant_vectors.json: byte-exact block test vectors for thorn's quant formats.

Run from the repository root with the PyPI `gguf` (0.19.0) and numpy installed:
    python3 tools/gen_quant_vectors.py
The oracle is gguf-py's numpy `quants.quantize`/`quants.dequantize` (independent of thorn's Rust code).
Types gguf-py cannot quantize (Q4_K, Q6_K, NVFP4) get random but well-formed blocks; their dequantization
still comes from gguf-py. FP8 E4M3 is not a GGUF type: its table is computed here from the OCP definition.
"""
import json
import numpy as np
from gguf import GGMLQuantizationType as T, quants
from gguf.constants import GGML_QUANT_SIZES

rng = np.random.default_rng(20261130)


def activations(n):
    x = rng.standard_normal(n).astype(np.float32)
    # SmolLM2-like outliers: a few large channels.
    x[rng.integers(0, n, max(1, n // 64))] *= 20
    return x


def record(name, qtype, raw: np.ndarray, n):
    raw = np.ascontiguousarray(raw)
    raw = raw.view(np.uint8).reshape(-1)
    if qtype == T.F32:
        deq = raw.view(np.float32)
    elif qtype == T.F16:
        deq = raw.view(np.float16).astype(np.float32)
    else:
        deq = quants.dequantize(raw.reshape(1, -1), qtype).astype(np.float32).reshape(-1)
    assert deq.size == n, (name, deq.size, n)
    x = activations(n)
    dot = float(np.sum(deq.astype(np.float64) * x.astype(np.float64)))
    return {"type": name, "id": int(qtype), "n": n, "bytes_hex": raw.tobytes().hex(),
            "dequant": [float(v) for v in deq], "x": [float(v) for v in x], "dot": dot}


def f16(lo, hi, n):
    return rng.uniform(lo, hi, n).astype(np.float16).view(np.uint8).reshape(n, 2)


out = []
for name, qtype, n in [("F32", T.F32, 64), ("F16", T.F16, 64), ("BF16", T.BF16, 64),
                       ("Q8_0", T.Q8_0, 128), ("Q4_0", T.Q4_0, 128), ("Q4_1", T.Q4_1, 128)]:
    w = activations(n) * 0.05
    w[:32] += 0.3  # a block with a non-zero mean exercises Q4_1's minimum
    if qtype == T.F32:
        raw = w.view(np.uint8)
    else:
        raw = quants.quantize(w.reshape(1, n), qtype)
    out.append(record(name, qtype, raw, n))

nb = 3
bs, ts = GGML_QUANT_SIZES[T.Q4_K]
q4k = np.concatenate([f16(0.001, 0.05, nb), f16(0.0, 0.02, nb),
                      rng.integers(0, 256, (nb, 12), dtype=np.uint8),
                      rng.integers(0, 256, (nb, 128), dtype=np.uint8)], axis=1)
q4k[0, 4:16] = 0xFF  # every scale/min bit set
out.append(record("Q4_K", T.Q4_K, q4k, nb * bs))

bs, ts = GGML_QUANT_SIZES[T.Q6_K]
q6k = np.concatenate([rng.integers(0, 256, (nb, 128), dtype=np.uint8),
                      rng.integers(0, 256, (nb, 64), dtype=np.uint8),
                      rng.integers(-128, 128, (nb, 16)).astype(np.int8).view(np.uint8),
                      f16(0.0005, 0.01, nb)], axis=1)
out.append(record("Q6_K", T.Q6_K, q6k, nb * bs))

nb = 4
bs, ts = GGML_QUANT_SIZES[T.NVFP4]
scales = rng.integers(0x20, 0x60, (nb, 4), dtype=np.uint8)
scales[0] = [0x00, 0x7F, 0xFF, 0x80]  # zero, ggml's "zero" NaN code, and sign bits that must be ignored
nv = np.concatenate([scales, rng.integers(0, 256, (nb, 32), dtype=np.uint8)], axis=1)
out.append(record("NVFP4", T.NVFP4, nv, nb * bs))


def e4m3(code):
    s = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 7
    if e == 15 and m == 7:
        return None
    return s * (m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


table = [e4m3(c) for c in range(256)]
finite = [(c, v) for c, v in enumerate(table) if v is not None and c < 0x80]


def encode(x):
    if abs(x) >= 448:
        return 0x7E | (0x80 if x < 0 else 0)
    a = abs(x)
    best = min(finite, key=lambda cv: (abs(cv[1] - a), cv[0] & 1))
    return best[0] | (0x80 if np.signbit(x) else 0)


probes = [0.0, -0.0, 1.0, -1.0, 448.0, 449.0, 1e6, -1e6, 464.0, 0.001, 2.0 ** -10, 3 * 2.0 ** -10,
          2.0 ** -6 * 0.999, 1.0625, 1.1875, 3.3, -0.3, 240.0, 250.0, 17.0, 0.015625]
probes += [float(v) for v in (rng.standard_normal(64) * 30).astype(np.float32)]
probes += [float(v) for v in (rng.standard_normal(32) * 0.01).astype(np.float32)]
fp8 = {"decode": [v if v is not None else "nan" for v in table],
       "encode": [[float(np.float32(p)), encode(float(np.float32(p)))] for p in probes]}

with open("crates/engine/testdata/quant_vectors.json", "w") as f:
    json.dump({"blocks": out, "fp8_e4m3": fp8}, f, separators=(",", ":"))
print("wrote", sum(len(b["dequant"]) for b in out), "elements in", len(out), "vectors")
