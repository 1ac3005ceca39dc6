#!/usr/bin/env python3
"""Side-by-side engine benchmark: thorn vs llama.cpp's llama-bench on the same GGUF and thread count.

Alternates the two programs round by round (so machine noise hits both alike), then prints medians and the
thorn/llama.cpp ratio as a Markdown table. Usage (from the repository root, release build present):

    LLAMA_BENCH=/path/to/llama-bench python3 tools/bench_vs_llamacpp.py --rounds 5 --threads 2

Several thorn configurations can take turns in the same rounds, each with its own column:
`--variant f32="--attention f32" --variant bf16="--attention bf16"` (NAME=extra `thorn bench engine` flags).

llama-bench comes from llama.cpp built from the llama-cpp-python sdist (see BENCHMARKS.md); its code is not
part of this repository.
"""
import argparse, json, os, shlex, statistics, subprocess, sys

ap = argparse.ArgumentParser()
ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--pp", type=int, default=512)
ap.add_argument("--tg", type=int, default=128)
ap.add_argument("--depths", default="1024,3000")
ap.add_argument("--model", default=None)
ap.add_argument("--thorn", default="target/release/thorn")
ap.add_argument("--variant", action="append", default=[],
                help="NAME=FLAGS: a thorn configuration (extra `thorn bench engine` flags); repeatable")
args = ap.parse_args()

bench = os.environ.get("LLAMA_BENCH")
if not bench:
    sys.exit("set LLAMA_BENCH to the llama-bench binary")
model = args.model or subprocess.run([args.thorn, "model", "pull", "-q"], check=True) and None
if model is None:
    cache = os.environ.get("THORN_CACHE_DIR") or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "thorn")
    model = os.path.join(cache, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
depths = [int(d) for d in args.depths.split(",") if d]
tests = ([f"pp{args.pp}"] + [f"pp{args.pp}@d{d}" for d in depths] + [f"tg{args.tg}"]
         + [f"tg{args.tg}@d{d}" for d in depths])
variants = [tuple(v.split("=", 1)) for v in args.variant] or [("thorn", "")]
ours = {name: {t: [] for t in tests} for name, _ in variants}
# llama.cpp with flash attention off and on: its default ("auto") picks on for this CPU build, which is
# slower at depth; the table compares against the better of the two per test.
peer = {fa: {t: [] for t in tests} for fa in ("0", "1")}

for r in range(args.rounds):
    for name, flags in variants:
        out = subprocess.run([args.thorn, "bench", "engine", "--model", model, "--threads", str(args.threads),
                              "--prompt-tokens", str(args.pp), "--gen-tokens", str(args.tg), "--depths",
                              args.depths, "--reps", "1", "--json", *shlex.split(flags)],
                             check=True, capture_output=True, text=True).stdout
        for item in json.loads(out)["results"]:
            ours[name][item["test"]].append(item["tok_per_s"])
    cmd = [bench, "-m", model, "-t", str(args.threads), "-p", str(args.pp), "-n", str(args.tg),
           "-d", ",".join(["0"] + [str(d) for d in depths]), "-fa", "0,1", "-r", "1", "-o", "json"]
    for item in json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout):
        depth, n_prompt, n_gen = item.get("n_depth", 0), item["n_prompt"], item["n_gen"]
        fa = "1" if item.get("flash_attn") in (1, True, "1", "on", "enabled") else "0"
        if n_prompt and not n_gen:
            peer[fa][f"pp{n_prompt}" + (f"@d{depth}" if depth else "")].append(item["avg_ts"])
        elif n_gen and not n_prompt:
            peer[fa][f"tg{n_gen}" + (f"@d{depth}" if depth else "")].append(item["avg_ts"])
    print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)

def spread(v):
    return f"{min(v):.1f}-{max(v):.1f}" if v else "-"

def med(v):
    return statistics.median(v) if v else float("nan")

names = [name for name, _ in variants]
print("| test | " + " | ".join(f"{n} tok/s (median, range)" for n in names)
      + " | llama.cpp -fa 0 | llama.cpp -fa 1 (its default here) | "
      + " | ".join(f"{n} / best llama.cpp" for n in names) + " |")
print("|---|" + "---|" * (2 * len(names) + 2))
for t in tests:
    b0, b1 = peer["0"][t], peer["1"][t]
    best = max(med(b0), med(b1))
    cols = [f"{med(ours[n][t]):.1f} ({spread(ours[n][t])})" for n in names]
    ratios = [f"{med(ours[n][t]) / best:.2f}x" for n in names]
    print(f"| {t} | " + " | ".join(cols) + f" | {med(b0):.1f} ({spread(b0)}) | {med(b1):.1f} ({spread(b1)}) | "
          + " | ".join(ratios) + " |")
print(json.dumps({"thorn": ours, "llama.cpp": peer}), file=sys.stderr)
