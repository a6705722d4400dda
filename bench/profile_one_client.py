"""Where one client's tokens go (issue 48): the runtime serving one streaming client, sampled
by py-spy (pinned, installed into its own venv under ~/.cache/ember on first use), for a git
ref ("before") and the working tree ("after"), each with the engine settings given.

Per run: the decode thread's active time by frame (inclusive: `llama_decode`, sampling, the
hand-off to the event loop), the other threads' share, tokens per second and ITL p50 of the
client. Idle time (the decode thread waiting for work) is not sampled.

    .venv/bin/python bench/profile_one_client.py [--before REF] [--requests 12]

Writes bench/results/profile_one_client.{md,json}.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.runtime_bench import PROMPTS, RESULTS, cpu_lock, cpu_model, git_commit
from tests.support.net import free_port

PY_SPY = "py-spy==0.4.0"
ROOT = Path(__file__).resolve().parent.parent
TOKENS = 64


def py_spy() -> Path:
    venv = Path.home() / ".cache" / "ember" / "py-spy-0.4.0"
    binary = venv / "bin" / "py-spy"
    if not binary.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", PY_SPY], check=True)
    return binary


def client(port: int, requests: int) -> dict[str, float]:
    """`requests` streaming greedy chat completions one after another: tok/s and ITL p50."""
    tokens, gaps, began = 0, [], time.perf_counter()
    for i in range(requests):
        body = {
            "prompt": f"Story {i}. {PROMPTS[i % len(PROMPTS)]}",
            "max_tokens": TOKENS,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        last = None
        url = f"http://127.0.0.1:{port}/v1/completions"
        with httpx.stream("POST", url, json=body, timeout=120) as reply:
            for line in reply.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens += chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
    gaps.sort()
    wall = time.perf_counter() - began
    return {"tok_s": tokens / wall, "itl_p50_ms": 1e3 * gaps[len(gaps) // 2]}


def summarise(raw: str) -> dict[str, Any]:
    """py-spy's raw (collapsed) stacks: each thread's share, and the decode thread's frames."""
    threads: collections.Counter[str] = collections.Counter()
    frames: collections.Counter[str] = collections.Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        parts = stack.split(";")
        thread = re.sub(r"^thread \(\d+\): ", "", parts[0])
        threads[thread] += int(count)
        if thread == "ember-decode":
            for frame in {re.sub(r" \(.*\)$", "", f) for f in parts[1:]}:
                frames[frame] += int(count)
    total, decode = sum(threads.values()), threads["ember-decode"]
    return {
        "samples": total,
        "threads": {t: n / total for t, n in threads.most_common()},
        "decode_frames": {f: n / decode for f, n in frames.most_common(16)},
    }


def profile(source: Path, engine: dict[str, Any], requests: int, spy: Path) -> dict[str, Any]:
    from tests.support.model import default_model_path

    model = default_model_path()
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "config.json"
        config.write_text(
            json.dumps({"modelName": model.stem, "modelDir": str(model.parent), "engine": engine})
        )
        argv = [sys.executable, "-m", "ember_runtime.server", "--config", str(config)]
        argv += ["--model", str(model), "--port", str(port), "--threads", "2"]
        argv += ["--max-batch-size", "4", "--context-length", "2048", "--log-level", "warning"]
        env = {**os.environ, "PYTHONPATH": str(source / "runtime")}
        server = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL)
        try:
            for _ in range(120):
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
            client(port, 3)  # warm
            out = Path(tmp) / "stacks.txt"
            spy_argv = [str(spy), "record", "-p", str(server.pid), "-r", "200", "-d", "20"]
            spy_argv += ["-f", "raw", "-o", str(out), "--threads", "--nonblocking"]
            spying = subprocess.Popen(
                spy_argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            speed = client(port, requests)
            spying.wait(timeout=60)
            return {**speed, **summarise(out.read_text())}
        finally:
            server.terminate()
            server.wait(timeout=30)


def report(summary: dict[str, Any]) -> str:
    lines = [
        f"`{summary['command']}` ({summary['cpu']}, 2 threads; one streaming client, greedy "
        f"chat, {TOKENS} tokens a request; commit {summary['commit']})",
        "",
    ]
    for name, run in summary["runs"].items():
        lines += [
            f"## {name}: {run['label']}",
            "",
            f"{run['tok_s']:.1f} tok/s end to end (TTFT included), ITL p50 "
            f"{run['itl_p50_ms']:.1f} ms; {run['samples']} samples",
            "",
            "Threads (share of samples): "
            + ", ".join(f"{t} {100 * s:.1f}%" for t, s in run["threads"].items()),
            "",
            "| decode thread frame (inclusive) | share |",
            "|---|---:|",
            *(f"| `{f}` | {100 * s:.1f}% |" for f, s in run["decode_frames"].items()),
            "",
        ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--before", default="HEAD~1", help="git ref of the 'before' runtime")
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--lock", default="/tmp/ember-cpu.lock")
    args = p.parse_args()
    spy = py_spy()
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(tmp) / "before"
        subprocess.run(["git", "worktree", "add", "-q", str(before), args.before], check=True)
        try:
            with cpu_lock(args.lock):
                cases = [
                    ("before", before, {}, f"{args.before}, its defaults"),
                    ("after, speculation off", ROOT, {"speculation": {"mode": "off"}}, "off"),
                    ("after", ROOT, {}, "the working tree, its defaults (speculation auto)"),
                ]
                for name, source, engine, label in cases:
                    runs[name] = {"label": label, **profile(source, engine, args.requests, spy)}
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(before)], check=False)
    summary = {
        "command": "python bench/profile_one_client.py " + " ".join(sys.argv[1:]),
        "commit": git_commit(),
        "cpu": cpu_model(),
        "runs": runs,
    }
    text = report(summary)
    print(text)
    (RESULTS / "profile_one_client.md").write_text(text + "\n")
    (RESULTS / "profile_one_client.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
