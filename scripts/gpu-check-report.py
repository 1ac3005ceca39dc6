"""The decode table of scripts/gpu-check's report, from the `thorn bench engine --json` files in $OUT."""
import json
import os
import sys

out = sys.argv[1]
print("\n## Decode on the GPU device\n")
# Runs: graphs on and off with packed Q4_1 weights (the default), and graphs on with the GGUF layout.
RUNS = (
    ("true", "graphs-true"),
    ("false", "graphs-false"),
    ("true, GGUF-layout weights", "graphs-true-gguf"),
    ("true, programmatic dependent launch", "graphs-true-pdl"),
)
print("| model | graphs | pp512 tok/s | tg128 tok/s | TPOT ms | tg128 at depth 1024 tok/s | tg128 at depth 4096 tok/s | kernels/step | in graphs | steps from a plan |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
tpot = {}
for name in ("qwen35", "smollm2"):
    for graphs, suffix in RUNS:
        path = os.path.join(out, f"bench-{name}-{suffix}.json")
        if not os.path.exists(path):
            continue
        try:
            b = json.load(open(path))
        except ValueError:  # a failed run leaves an empty or partial file; its error is in tests.log
            print(f"| {name} | {graphs} | failed (see tests.log) | | | | | | | |")
            continue
        r = {x["test"]: x["tok_per_s"] for x in b["results"]}
        tg = r.get("tg128", 0.0)
        tpot[(name, graphs)] = 1000.0 / tg if tg else float("nan")
        share = b.get("graph_share_of_kernels") or 0.0
        kernels = b.get("kernels_per_decode_step") or 0.0
        planned = b.get("plan_share_of_steps") or 0.0
        print(
            f"| {name} | {graphs} | {r.get('pp512', 0):.0f} | {tg:.0f} | {tpot[(name, graphs)]:.3f} | "
            f"{r.get('tg128@d1024', 0):.0f} | {r.get('tg128@d4096', 0):.0f} | {kernels:.0f} | {100 * share:.0f}% | "
            f"{100 * planned:.0f}% |"
        )
for name in ("qwen35", "smollm2"):
    if (name, "true") in tpot and (name, "false") in tpot:
        on, off = tpot[(name, "true")], tpot[(name, "false")]
        print(
            f"\n- {name}: graphs save {100 * (1 - on / off):.0f}% of a decode step (TPOT {off:.3f} ms "
            f"without, {on:.3f} ms with), what launching kernel by kernel costs a step"
        )
if ("smollm2", "true") in tpot and ("smollm2", "true, GGUF-layout weights") in tpot:
    packed, gguf = tpot[("smollm2", "true")], tpot[("smollm2", "true, GGUF-layout weights")]
    print(f"\n- smollm2: packed Q4_1 weights take {packed / gguf:.2f}x the GGUF layout's TPOT ({packed:.3f} vs {gguf:.3f} ms)")
if ("smollm2", "true") in tpot and ("smollm2", "true, programmatic dependent launch") in tpot:
    plain, pdl = tpot[("smollm2", "true")], tpot[("smollm2", "true, programmatic dependent launch")]
    print(f"\n- smollm2: programmatic dependent launch takes {pdl / plain:.2f}x the TPOT without ({pdl:.3f} vs {plain:.3f} ms)")
for name, suffix in [(n, s) for n in ("qwen35", "smollm2") for s in ("graphs-true", "graphs-true-gguf")]:
    path = os.path.join(out, f"bench-{name}-{suffix}.json")
    try:
        b = json.load(open(path))
    except (OSError, ValueError):
        continue
    for at in b.get("kernel_times") or []:
        print(
            f"\n### {name} ({suffix}): kernel times per decode step at depth {at['depth']} "
            f"({at['us_per_step']:.1f} us, graphs off, events around each launch)\n"
        )
        print("| kernel | launches/step | us/step | us/launch | share |")
        print("|---|---:|---:|---:|---:|")
        for k in at["kernels"]:
            n = max(k["launches_per_step"], 1e-9)
            share = 100 * k["us_per_step"] / max(at["us_per_step"], 1e-9)
            print(f"| {k['name']} | {n:.1f} | {k['us_per_step']:.1f} | {k['us_per_step'] / n:.2f} | {share:.1f}% |")
