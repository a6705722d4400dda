"""The real-client matrix (tests/conformance/cases.py) against Ember's runtime and against
llama.cpp's `llama-server --jinja`, on the same GGUF (Gemma 3 270M Q4_K_M): which everyday calls
of the `openai` package, LangChain and LiteLLM each server answers.

Ember runs as tests/conformance runs it (in-process, the real engine: capacity 4, 512 tokens
per sequence, 1 thread); llama-server with the same shape (`-np 4 -c 2048 -t 1`) and `--jinja`
(the model's own chat template, which its tool calls need). Embedding cases go to a second
instance of each serving the same GGUF as an embedding model: Ember with `task: embed` and mean
pooling, llama-server with `--embeddings --pooling mean`. One server runs at a time.

An outcome is `ok`, `length` (a schema-less JSON reply cut by max_tokens: the base model's
doing, judged the same on both) or `fail` with the client's error text. Ember should pass every
call llama-server passes, and refuse only with a 400 that names the field.

    flock /tmp/ember-bench.lock .venv/bin/python -m bench.clients_matrix   # takes the lock itself

Writes `bench/results/clients.{md,json}`.
"""

from __future__ import annotations

import argparse
import fcntl
import json
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

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ember_runtime.models import default_model_path
from ember_runtime.server.app import create_app

from bench.runtime_bench import Server
from images.llama_build import VERSION as LLAMA_CPP_VERSION
from images.llama_build import ensure_llama_server
from tests.conformance.cases import CASES, Case, LengthLimit
from tests.conformance.conftest import embed_config
from tests.runtime.conftest import CAPACITY, CONTEXT, make_config, start_live
from tests.support.net import free_port

RESULTS = Path(__file__).resolve().parent / "results"
LOCK = "/tmp/ember-bench.lock"
SERVERS = ("ember", "llama-server")
RANK = {"ok": 2, "length": 1, "fail": 0}
DETAIL_CHARS = 220  # of an error's text in the table (the JSON keeps 2,000)

Endpoint = tuple[str, str]  # (server root URL, model name) or a reason it could not start


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
    port = free_port()
    name = "llama-server-embed" if embed else "llama-server"
    server = Server(name, llama_server_argv(port, embed), port, health="/health")
    server.start(log_dir)
    try:
        props = httpx.get(server.base + "/props", timeout=30).text  # its chat template, for notes
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


def table(results: dict[str, dict[str, Outcome]], header: list[str]) -> str:
    lines = [*header, "", "| call | Ember | llama-server |", "|---|---|---|"]
    for case in CASES:
        cells = " | ".join(_cell(results[server][case.id]) for server in SERVERS)
        lines.append(f"| {case.id} | {cells} |")
    lines.append("")
    for server in SERVERS:
        counts = {k: sum(r.outcome == k for r in results[server].values()) for k in RANK}
        lines.append(
            f"- {server}: {counts['ok']} ok, {counts['length']} length, {counts['fail']} fail "
            f"of {len(CASES)}"
        )
    lag = behind(results)
    lines.append(
        f"- Ember behind llama-server on {len(lag)} call(s){': ' + ', '.join(lag) if lag else ''}"
    )
    return "\n".join(lines) + "\n"


def llama_server_notes(log_dir: Path) -> list[str]:
    """What llama-server said about this run: its chat template and its distinct warnings."""
    notes = ["", "llama-server's own account of the run:", ""]
    props = log_dir / "llama-server.props.json"
    if props.exists():
        template = str(json.loads(props.read_text()).get("chat_template", ""))
        notes.append(f"- chat template (GET /props): `{' '.join(template.split())[:120]}`")
    warnings: set[str] = set()
    for log in sorted(log_dir.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            parts = line.split(" ", 2)
            if len(parts) == 3 and parts[1] == "W":  # "<time> W <message>"
                warnings.add(f"{log.stem}: {' '.join(parts[2].split())}")
    notes += [f"- warning: {w[:300]}" for w in sorted(warnings)]
    return notes


def describe() -> list[str]:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
        cwd=RESULTS.parent,
    ).stdout.strip()
    clients = ", ".join(
        f"{p} {version(p)}" for p in ("openai", "langchain-openai", "langchain-core", "litellm")
    )
    return [
        "# Real clients against Ember and llama-server (issue 36)",
        "",
        f"Model: {default_model_path().name}; Ember at commit {commit}, capacity {CAPACITY}, "
        f"{CONTEXT} tokens per sequence; llama-server from llama-cpp-python {LLAMA_CPP_VERSION}'s "
        f"llama.cpp: `llama-server -m <gguf> {' '.join(LLAMA_FLAGS)}`; "
        "embedding cases on a second instance of each (Ember `task: embed`, mean pooling; "
        f"llama-server `{' '.join(EMBED_FLAGS)}`).",
        f"Clients: {clients}. Written by `bench/clients_matrix.py`; cases in "
        "`tests/conformance/cases.py`. `length`: a schema-less JSON reply cut at max_tokens "
        "(base model), judged alike on both.",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(RESULTS / "clients"), help="path stem of .md/.json")
    args = parser.parse_args()
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # benches serialise on the machine's one lock
        log_dir = Path(tempfile.mkdtemp(prefix="clients-matrix-"))
        print(f"llama-server logs: {log_dir}", file=sys.stderr)
        results = {
            "ember": run_matrix("ember", ember),
            "llama-server": run_matrix("llama-server", lambda e: llama_server(e, log_dir)),
        }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    header = describe()
    notes = llama_server_notes(log_dir)
    out.with_suffix(".md").write_text(table(results, header) + "\n".join(notes) + "\n")
    data = {
        "header": header,
        "cases": [{"id": c.id, **{s: asdict(results[s][c.id]) for s in SERVERS}} for c in CASES],
        "behind": behind(results),
        "llama_server_notes": notes,
    }
    out.with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n")
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
