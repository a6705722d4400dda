"""The real-client matrix against Ember's runtime and against llama.cpp's `llama-server`, on the
same GGUF (Gemma 3 270M Q4_K_M, a base model without a chat template of its own): the 36
everyday calls of the `openai` package, LangChain and LiteLLM in tests/conformance/cases.py, run
on each server in turn (one server up at a time), and each call's outcome tabulated.

Both servers render the same prompt, so the two differ only in their servers. Ember renders
llama.cpp's built-in `gemma` template (its fallback for a Gemma GGUF without one); llama-server,
whose own fallback is ChatML, is given that template as Jinja (`--jinja --chat-template-file
bench/templates/gemma.jinja`; --jinja because its tool calls need it). tests/conformance/
test_template.py checks that llama-server, started as here, renders Ember's prompt token for
token. Same shape: Ember in-process as tests/conformance runs it (the real engine, capacity 4,
512 tokens per sequence, 1 thread); llama-server `-np 4 -c 2048 -t 1 -tb 1`. Embedding calls go
to a second instance of each serving the GGUF as an embedding model: Ember `task: embed` with
mean pooling, llama-server `--embeddings --pooling mean`.

Outcomes: `ok`, the only pass; `length`, a schema-less JSON reply cut at max_tokens
(finish_reason "length"), named apart; `fail` with the client's error text. Failures of calls
that name their function with an object `tool_choice`, which llama-server does not read, are
counted apart from the other failures.

Run it alone, under the lock the machine's benchmarks share (it takes no lock itself). About 5
minutes on this project's 2-core box:

    flock /tmp/ember-cpu.lock .venv/bin/python -m bench.clients_matrix [--out STEM]

Writes `bench/results/clients.{md,json}` (STEM.md and STEM.json with --out): what each server ran
with (template, flags), the clients' versions, the load average, the table, the counts, and
llama-server's own account (its template's capabilities from GET /props, its warnings).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ember_runtime.server.app import create_app

from bench.runtime_bench import Server
from images.llama_build import VERSION as LLAMA_CPP_VERSION
from images.llama_build import ensure_llama_server
from tests.conformance.cases import CASES, Case, LengthLimit
from tests.conformance.conftest import embed_config
from tests.runtime.conftest import CAPACITY, CONTEXT, make_config, start_live
from tests.support.model import default_model_path
from tests.support.net import free_port

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
GEMMA_TEMPLATE = ROOT / "bench" / "templates" / "gemma.jinja"
SERVERS = ("ember", "llama-server")
RANK = {"ok": 2, "length": 1, "fail": 0}
DETAIL_CHARS = 220  # of an error's text in the table (the JSON keeps 2,000)
CLIENTS = ("openai", "langchain-openai", "langchain-core", "litellm")

Endpoint = tuple[str, str]  # (server root URL, model name)


@dataclass
class Outcome:
    outcome: str  # ok | length | fail
    detail: str
    seconds: float


def run_case(case: Case, url: str, model: str) -> Outcome:
    start = time.monotonic()
    try:
        case.run(url, model)
    except LengthLimit as exc:
        return Outcome("length", str(exc)[:2000], time.monotonic() - start)
    except Exception as exc:  # any failure of the client is the finding
        text = f"{type(exc).__name__}: {exc}" if str(exc) else traceback.format_exc(limit=2)
        return Outcome("fail", text[:2000], time.monotonic() - start)
    return Outcome("ok", "", time.monotonic() - start)


def model_id(url: str) -> str:
    return str(httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"])


@contextmanager
def ember(embed: bool) -> Iterator[Endpoint]:
    with tempfile.TemporaryDirectory(prefix="ember-clients-") as tmp:
        config = embed_config(Path(tmp)) if embed else make_config(Path(tmp), maxQueue=16)
        live = start_live(create_app(config, model_path=default_model_path()))
        try:
            yield live.url, model_id(live.url)
        finally:
            live.stop()


LLAMA_FLAGS = [
    "--jinja",
    "--chat-template-file",
    str(GEMMA_TEMPLATE),
    "-t",
    "1",
    "-tb",
    "1",
    "-np",
    str(CAPACITY),
    "-c",
    str(CAPACITY * CONTEXT),
]
EMBED_FLAGS = ["--embeddings", "--pooling", "mean"]


def llama_server_argv(port: int, embed: bool) -> list[str]:
    argv = [str(ensure_llama_server()), "-m", str(default_model_path())]
    argv += ["--host", "127.0.0.1", "--port", str(port), *LLAMA_FLAGS]
    return argv + (EMBED_FLAGS if embed else [])


@contextmanager
def llama_server(embed: bool, log_dir: Path) -> Iterator[Endpoint]:
    """llama-server as the matrix runs it; its GET /props is kept in log_dir for the notes."""
    port = free_port()
    name = "llama-server-embed" if embed else "llama-server"
    server = Server(name, llama_server_argv(port, embed), port, health="/health")
    server.start(log_dir)
    try:
        props = httpx.get(server.base + "/props", timeout=30).text
        (log_dir / f"{name}.props.json").write_text(props)
        yield server.base, model_id(server.base)
    finally:
        server.stop()


def run_matrix(
    name: str, start: Callable[[bool], AbstractContextManager[Endpoint]]
) -> dict[str, Outcome]:
    """Every case on one server kind: the generation instance, then the embedding one."""
    out: dict[str, Outcome] = {}
    for embed in (False, True):
        cases = [c for c in CASES if c.embed == embed]
        try:
            with start(embed) as (url, model):
                for case in cases:
                    out[case.id] = result = run_case(case, url, model)
                    print(f"{name:13} {result.outcome:6} {case.id}", file=sys.stderr)
        except Exception as exc:  # a server that cannot start fails its cases
            reason = f"the server did not start: {type(exc).__name__}: {exc}"[:2000]
            out.update({c.id: Outcome("fail", reason, 0.0) for c in cases if c.id not in out})
    return out


def _cell(result: Outcome) -> str:
    if result.outcome == "ok":
        return "ok"
    text = " ".join(result.detail.split())[:DETAIL_CHARS].replace("|", "\\|")
    return f"**{result.outcome}**: {text}"


def behind(results: dict[str, dict[str, Outcome]]) -> list[str]:
    """The calls where Ember does worse than llama-server."""
    return [
        case.id
        for case in CASES
        if RANK[results["ember"][case.id].outcome] < RANK[results["llama-server"][case.id].outcome]
    ]


def verdicts(outcomes: dict[str, Outcome]) -> dict[str, list[str]]:
    """One server's calls by verdict: passed, cut at max_tokens, failed with an object
    tool_choice, failed otherwise."""
    groups: dict[str, list[str]] = {"ok": [], "length": [], "fail_tool_choice": [], "fail": []}
    for case in CASES:
        kind = outcomes[case.id].outcome
        if kind == "fail" and case.tool_choice_object:
            kind = "fail_tool_choice"
        groups[kind].append(case.id)
    return groups


def _listed(ids: list[str]) -> str:
    return f" ({'; '.join(ids)})" if ids else ""


def summary(results: dict[str, dict[str, Outcome]]) -> list[str]:
    lines = []
    for server in SERVERS:
        v = verdicts(results[server])
        lines.append(
            f"- {server}: {len(v['ok'])} of {len(CASES)} pass; "
            f"cut at max_tokens {len(v['length'])}{_listed(v['length'])}; "
            f"failed with an object tool_choice {len(v['fail_tool_choice'])}"
            f"{_listed(v['fail_tool_choice'])}; other failures {len(v['fail'])}{_listed(v['fail'])}"
        )
    lag = behind(results)
    lines.append(f"- Ember behind llama-server on {len(lag)} call(s){_listed(lag)}")
    return lines


def table(results: dict[str, dict[str, Outcome]]) -> list[str]:
    lines = ["| call | Ember | llama-server |", "|---|---|---|"]
    for case in CASES:
        cells = " | ".join(_cell(results[server][case.id]) for server in SERVERS)
        mark = " ¹" if case.tool_choice_object else ""
        lines.append(f"| {case.id}{mark} | {cells} |")
    lines.append("")
    lines.append(
        "¹ names its function with an object `tool_choice` "
        '(`{"type": "function", "function": {"name": ...}}`; LangChain sends one for '
        '`bind_tools(tool_choice=name)` and `with_structured_output(method="function_calling")`).'
    )
    return lines


def llama_server_notes(log_dir: Path) -> list[str]:
    """What llama-server said about this run: its template as it loaded it, the template's
    capabilities as it detected them, and its distinct warnings."""
    notes = ["llama-server's own account of the run:", ""]
    props = log_dir / "llama-server.props.json"
    if props.exists():
        data: dict[str, Any] = json.loads(props.read_text())
        # llama-server keeps the file's text less its trailing newline.
        same = str(data.get("chat_template", "")).strip() == GEMMA_TEMPLATE.read_text().strip()
        notes.append(
            f"- chat template (GET /props): {'is' if same else 'is NOT'} "
            f"{GEMMA_TEMPLATE.relative_to(ROOT)}; capabilities: "
            f"`{json.dumps(data.get('chat_template_caps'), sort_keys=True)}`"
        )
    warnings: set[str] = set()
    for log in sorted(log_dir.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            parts = line.split(" ", 2)
            if len(parts) == 3 and parts[1] == "W":  # "<time> W <message>"
                warnings.add(f"{log.stem}: {' '.join(parts[2].split())}")
    notes += [f"- warning: {w[:300]}" for w in sorted(warnings)]
    return notes


def _commit() -> str:
    def git(*args: str) -> str:
        run = subprocess.run(["git", *args], capture_output=True, text=True, check=False, cwd=ROOT)
        return run.stdout.strip()

    dirty = " + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else ""
    return git("rev-parse", "--short", "HEAD") + dirty


def _loadavg(load: tuple[float, float, float]) -> str:
    return " ".join(f"{x:.2f}" for x in load)


def describe(load_before: tuple[float, float, float], wall_s: float) -> list[str]:
    clients = ", ".join(f"{p} {version(p)}" for p in CLIENTS)
    flags = shlex.join(a.replace(str(ROOT) + "/", "") for a in LLAMA_FLAGS)
    return [
        "# Real clients against Ember and llama-server (issues 36, 46)",
        "",
        f"- Model: {default_model_path().name} (base; the GGUF has no chat template). "
        "Both servers render the same prompt (tests/conformance/test_template.py checks it).",
        f"- Ember at commit {_commit()}: in-process, the llama.cpp engine, llama.cpp's built-in "
        f"`gemma` chat template; capacity {CAPACITY}, {CONTEXT} tokens per sequence, 1 thread.",
        f"- llama-server from llama-cpp-python {LLAMA_CPP_VERSION}'s llama.cpp (same commit and "
        f"build flags as Ember's bindings): `llama-server -m <gguf> {flags}`.",
        "- Embedding calls: a second instance of each (Ember `task: embed`, mean pooling; "
        f"llama-server `{shlex.join(EMBED_FLAGS)}`).",
        f"- Clients: {clients}.",
        f"- Load average (1, 5, 15 min) at start {_loadavg(load_before)}, at end "
        f"{_loadavg(os.getloadavg())} (2 CPUs); the run took {wall_s:.0f} s.",
        "- Written by `flock /tmp/ember-cpu.lock .venv/bin/python -m bench.clients_matrix`; "
        "calls in `tests/conformance/cases.py`. Verdicts: `ok` is the only pass; `length` is a "
        "schema-less JSON reply cut at max_tokens.",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(RESULTS / "clients"), help="path stem of .md/.json")
    args = parser.parse_args()
    load_before, started = os.getloadavg(), time.monotonic()
    log_dir = Path(tempfile.mkdtemp(prefix="clients-matrix-"))
    print(f"llama-server logs: {log_dir}", file=sys.stderr)
    results = {
        "ember": run_matrix("ember", ember),
        "llama-server": run_matrix("llama-server", lambda e: llama_server(e, log_dir)),
    }
    header = describe(load_before, time.monotonic() - started)
    lines, notes = summary(results), llama_server_notes(log_dir)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    md = [*header, "", *table(results), "", *lines, "", *notes]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    data = {
        "header": header,
        "cases": [
            {
                "id": c.id,
                "tool_choice_object": c.tool_choice_object,
                **{s: asdict(results[s][c.id]) for s in SERVERS},
            }
            for c in CASES
        ],
        "verdicts": {s: verdicts(results[s]) for s in SERVERS},
        "behind": behind(results),
        "summary": lines,
        "llama_server_notes": notes,
    }
    out.with_suffix(".json").write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
