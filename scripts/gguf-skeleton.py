#!/usr/bin/env python3
"""A GGUF model's header alone, and the same header filled with seeded random weights.

  gguf-skeleton.py header MODEL OUT   writes MODEL's header (metadata, tokenizer, tensor table; the bytes
                                      before its tensor data) to OUT: a few MB instead of the model.
  gguf-skeleton.py fill HEADER OUT    writes a whole GGUF to OUT: HEADER, then every tensor's bytes from
                                      a fixed seed, with sane block scales (Q4_0/Q4_1/Q8_0/Q6_K/Q4_K; small
                                      floats for F32/F16), so that engines load and run it at the speed of the
                                      real weights (no kernel's speed depends on their values).

Standard library only (the GPU machine has no network).
"""

import random
import struct
import sys

# (block size in values, bytes per block) per GGML type id.
TYPES = {
    0: (1, 4),  # F32
    1: (1, 2),  # F16
    2: (32, 18),  # Q4_0
    3: (32, 20),  # Q4_1
    6: (32, 22),  # Q5_0
    7: (32, 24),  # Q5_1
    8: (32, 34),  # Q8_0
    10: (256, 84),  # Q2_K
    11: (256, 110),  # Q3_K
    12: (256, 144),  # Q4_K
    13: (256, 176),  # Q5_K
    14: (256, 210),  # Q6_K
    30: (1, 2),  # BF16
}
SCALAR = {0: "<I", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class Reader:
    def __init__(self, data):
        self.data, self.pos = data, 0

    def take(self, fmt):
        v = struct.unpack_from(fmt, self.data, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return v

    def string(self):
        n = self.take("<Q")
        s = self.data[self.pos : self.pos + n]
        self.pos += n
        return s.decode("utf-8", "replace")

    def value(self, ty):
        if ty == 8:
            return self.string()
        if ty == 9:
            inner, n = self.take("<I"), self.take("<Q")
            return [self.value(inner) for _ in range(n)]
        return self.take(SCALAR[ty])


def parse(data):
    """(tensors as (name, dims, type, offset), the data start) of a GGUF's bytes (its header at least)."""
    r = Reader(data)
    if r.take("<4s") != b"GGUF":
        sys.exit("not a GGUF file")
    version, n_tensors, n_kv = r.take("<I"), r.take("<Q"), r.take("<Q")
    if version < 2:
        sys.exit(f"GGUF version {version} is not supported")
    align = 32
    for _ in range(n_kv):
        key = r.string()
        v = r.value(r.take("<I"))
        if key == "general.alignment":
            align = v
    tensors = []
    for _ in range(n_tensors):
        name = r.string()
        dims = [r.take("<Q") for _ in range(r.take("<I"))]
        tensors.append((name, dims, r.take("<I"), r.take("<Q")))
    start = (r.pos + align - 1) // align * align
    return tensors, start


def nbytes(dims, ty):
    if ty not in TYPES:
        sys.exit(f"tensor type {ty} is not supported here")
    block, size = TYPES[ty]
    n = 1
    for d in dims:
        n *= d
    return n // block * size


def fill(ty, n, rng):
    """n bytes of tensor data of type ty: random, with each block's scales set to sane values."""
    buf = bytearray(rng.randbytes(n))
    half = lambda x: struct.pack("<e", x)
    if ty in (0, 1, 30):
        fmt, size = {0: ("<f", 4), 1: ("<e", 2), 30: ("<e", 2)}[ty]
        vals = [rng.uniform(-0.05, 0.05) for _ in range(1024)]
        pattern = b"".join(struct.pack(fmt, v) for v in vals)
        reps = n // len(pattern) + 1
        return (pattern * reps)[:n]
    block, size = TYPES[ty]
    scale_at = {2: [(0, 0.01)], 3: [(0, 0.01), (2, -0.075)], 6: [(0, 0.01)], 7: [(0, 0.01), (2, -0.075)],
                8: [(0, 0.01)], 12: [(0, 0.001), (2, 0.001)], 13: [(0, 0.001), (2, 0.001)], 14: [(208, 0.001)],
                10: [(80, 0.001), (82, 0.001)], 11: [(108, 0.001)]}[ty]
    for at, v in scale_at:
        b = half(v)
        blocks = n // size
        buf[at::size] = bytes([b[0]]) * blocks
        buf[at + 1 :: size] = bytes([b[1]]) * blocks
    return bytes(buf)


def main():
    if len(sys.argv) != 4 or sys.argv[1] not in ("header", "fill"):
        sys.exit("usage: gguf-skeleton.py header MODEL OUT | fill HEADER OUT")
    mode, src, dst = sys.argv[1:]
    if mode == "header":
        with open(src, "rb") as f:
            head = f.read(64 << 20)
        _, start = parse(head)
        with open(dst, "wb") as f:
            f.write(head[:start])
        return
    with open(src, "rb") as f:
        head = f.read()
    tensors, start = parse(head)
    rng = random.Random(20261206)
    with open(dst, "wb") as f:
        f.write(head[:start])
        at = 0
        for name, dims, ty, offset in sorted(tensors, key=lambda t: t[3]):
            if offset < at:
                sys.exit(f"tensor {name} overlaps the one before it")
            f.write(b"\0" * (offset - at))
            n = nbytes(dims, ty)
            f.write(fill(ty, n, rng))
            at = offset + n


if __name__ == "__main__":
    main()
