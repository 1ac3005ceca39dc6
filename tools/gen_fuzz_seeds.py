#!/usr/bin/env python3
"""Writes small valid GGUF files into fuzz/corpus/gguf as fuzzing seeds (run from the repository root)."""
import os
import numpy as np
from gguf import GGUFWriter, GGMLQuantizationType as T, quants

out = "fuzz/corpus/gguf"
os.makedirs(out, exist_ok=True)
rng = np.random.default_rng(1)

for i, qtype in enumerate([T.F32, T.Q4_1, T.Q8_0, T.Q4_0, T.F16]):
    path = f"{out}/seed{i}.gguf"
    w = GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    toks = ["<|im_start|>", "<|im_end|>", "a", "b", "ab", "Ġ", "1", "2", "3", "h", "é"]
    w.add_token_list(toks)
    w.add_token_types([3, 3] + [1] * (len(toks) - 2))
    w.add_token_merges(["a b"])
    w.add_eos_token_id(1)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    if qtype == T.F32:
        w.add_tensor("w", x)
    elif qtype == T.F16:
        w.add_tensor("w", x.astype(np.float16))
    else:
        w.add_tensor("w", quants.quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
print("seeds in", out)
