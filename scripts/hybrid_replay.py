#!/usr/bin/env python3
"""A teacher-forced multi-turn agent conversation against one server, as raw completions (used by
scripts/bench-hybrid-vs-llamacpp). Prints per turn: prompt tokens, tokens served from the cache, wall time.

usage: hybrid_replay.py thorn|llama URL TURNS [CONVERSATIONS]

With several conversations their turns interleave (conversation 0's turn k, then 1's, ...), as when one
host serves several agents.
"""
import json
import sys
import time
import urllib.request

SYSTEM = (
    "You are the controller of a six-joint robot arm. Answer with one tool call per turn. Tools: "
    "move_joint(joint: integer 0-5, degrees: number -180..180) rotates one joint relative to its current "
    "position; set_gripper(open: boolean, force: number 0..40) opens or closes the gripper with a force limit "
    "in newtons; home() returns every joint to zero; read_sensors() returns joint angles, motor currents and "
    "the gripper state as JSON; wait(ms: integer 0..10000) pauses. Never exceed the joint limits, never move "
    "while the gripper is closed on an object heavier than 2 kg, and report any sensor fault instead of "
    "moving. Keep answers short: the operator reads them on a small screen."
)


def post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as r:
        data = json.load(r)
    return data, time.perf_counter() - t


def main():
    server, url, turns = sys.argv[1], sys.argv[2], int(sys.argv[3])
    convs = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    prompts = [f"<system>{SYSTEM} You control arm {c}.</system>\n<user>Home the arm.</user>\n" for c in range(convs)]
    out = []
    for k in range(turns):
        for c in range(convs):
            prompt = prompts[c]
            if server == "thorn":
                data, wall = post(f"{url}/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0})
                n = data["usage"]["prompt_tokens"]
                cached = data["usage"]["prompt_tokens_details"]["cached_tokens"]
            else:
                data, wall = post(
                    f"{url}/completion",
                    {"prompt": prompt, "n_predict": 1, "temperature": 0, "cache_prompt": True},
                )
                n = data["tokens_evaluated"]
                cached = n - data["timings"]["prompt_n"]
            out.append({"turn": k, "conversation": c, "prompt": n, "cached": cached, "wall": wall})
            # A fixed reply and tool result, so every server sees the same prompts.
            prompts[c] += (
                f'<assistant><tool_call>{{"name": "move_joint", "arguments": {{"joint": {k % 6}, "degrees": '
                f"{(k * 7 + c) % 90}}}}}</tool_call></assistant>\n<tool>ok: joint {k % 6} at {(k * 7 + c) % 90} "
                f"deg, current {0.4 + 0.01 * k:.2f} A</tool>\n<user>Next step {k + 1}.</user>\n"
            )
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
