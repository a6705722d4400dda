"""The scheduling policy of the llama.cpp engine: who joins the next step, and in which calls.

Pure Python, no model: the engine hands it the running sequences (each one only needs its
prompt length and how much of the prompt is already in the KV cache) and gets back the
`llama_decode` calls of one step. Unit-tested in tests/runtime/test_scheduler.py.

The rules, and why:

* **Preemption by the thermal limit.** The batch limit (`/admin/batch`, lowered as the device
  heats) caps how many sequences take part in a step. The oldest keep going; the newest pause
  with their KV cells kept, so they resume where they stopped once the limit rises again. No
  work is thrown away, and a stream that started first finishes first.
* **Admission.** A waiting request joins as soon as a sequence slot is free and the batch
  limit allows it, at the start of the very next step (no waiting for a "wave" to finish).
* **Fast mode (default): one call per step**, as llama-server does: one row for every
  decoding sequence, then prompt chunks in arrival order within `step_tokens` prompt tokens,
  each sequence's chunk at most `chunk_tokens` (a long prompt in one call pays attention over
  the masked half of its own cells: contract/config.py has the measurement).
  Decodes always go first, so a burst of new prompts costs the running streams at most one
  `step_tokens` chunk of extra work per token (their inter-token latency stays bounded),
  while a long prompt is split over several steps instead of stalling everyone at once.
  The budget (1024 by default) is a trade: cutting a burst finer spreads the running streams'
  stall over more tokens without shrinking it, and every extra step pays the decode rows'
  output layer again (262k columns for Gemma 3), which delays the burst's last first token.
  At 256 a 16-prompt burst took five steps and its TTFT p99 was 1.24x llama-server's; at
  1024 it takes one or two, 0.92-0.96x (bench/runtime_bench.py; the full run of the default
  is in bench/results/runtime_bench.md).
  Prompts go in arrival order, each sequence's chunk capped at `chunk_tokens` (256): the
  short prompts of a burst all fit the first step, while long ones share each step's budget
  (four RAG prompts of ~1,540 tokens: 256 each a step). The burst's last first token waits
  for all its prompt tokens either way, while its first one now comes later than in pure
  arrival order (the mean rises, the p99 does not); the cap costs a little less attention
  per token (contract/config.py has the measurement).
* **Deterministic mode**: a request's greedy output must not depend on its neighbours. On
  CPU, llama.cpp's kernels change with the number of rows in a call (the engine probes the
  widest call that still matches single rows, `exact_rows`) and with how a prompt is cut.
  So decode rows go in calls of at most `exact_rows`, and the first waiting prompt gets one
  call of its own per step whose boundaries depend only on the prompt itself (multiples of
  `step_tokens` from position 0): exactly the calls it would get alone.
* **LoRA adapters split calls** (`split_by_adapter`): llama.cpp applies adapters to a whole
  context, not per sequence, so one `llama_decode` holds rows of one adapter set only. A step
  with requests for k different adapters (the base counts as one) is k calls, each a pass
  over the weights: mixed-adapter traffic batches only within each adapter (not measured
  here: the cost grows with k, like k smaller batches instead of one).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from ember_runtime.contract.config import DEFAULT_CHUNK_TOKENS, DEFAULT_STEP_TOKENS


class Schedulable(Protocol):
    """What the policy needs to know about one running sequence."""

    @property
    def prompt_len(self) -> int: ...

    @property
    def prefilled(self) -> int:
        """Prompt tokens already in (or submitted to) the KV cache."""


S = TypeVar("S", bound=Schedulable)


@dataclass(frozen=True, slots=True)
class Chunk(Generic[S]):
    """Prompt tokens [start, start + count) of `seq` in one call."""

    seq: S
    start: int
    count: int

    @property
    def completes_prompt(self) -> bool:
        """True when this chunk holds the prompt's last token (its logits give token one)."""
        return self.start + self.count == self.seq.prompt_len


@dataclass(slots=True)
class Call(Generic[S]):
    """One `llama_decode`: a row per decoding sequence, then prompt chunks."""

    decodes: list[S] = field(default_factory=list)
    chunks: list[Chunk[S]] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return len(self.decodes) + sum(c.count for c in self.chunks)


@dataclass(frozen=True, slots=True)
class Policy:
    deterministic: bool = False
    step_tokens: int = DEFAULT_STEP_TOKENS  # prompt tokens per step (fast); the chunk (determ.)
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS  # fast: one sequence's prompt tokens per step
    exact_rows: int = 1  # deterministic: the widest decode call, probed at load

    def __post_init__(self) -> None:
        if min(self.step_tokens, self.chunk_tokens, self.exact_rows) < 1:
            raise ValueError("step_tokens, chunk_tokens and exact_rows must be at least 1")


def admissible(running: int, waiting: int, max_batch: int, free_slots: int) -> int:
    """How many waiting requests join now: every one that a free slot and the limit allow."""
    return max(0, min(waiting, free_slots, max_batch - running))


def queued(running: int, waiting: int, max_batch: int, free_slots: int) -> int:
    """Waiting requests that the next step will not admit: what the admission bound counts.

    A request that a free slot takes at the next step is not queued, whether or not the
    decode thread has woken to take it yet, so a burst's 429s do not depend on that thread.
    """
    return waiting - admissible(running, waiting, max_batch, free_slots)


def split_active(running: Sequence[S], max_batch: int) -> tuple[list[S], list[S]]:
    """(active, paused): the oldest `max_batch` take part in the step, the newest pause."""
    return list(running[:max_batch]), list(running[max_batch:])


def decoding(seq: Schedulable) -> bool:
    """Whether the whole prompt is in: the sequence decodes a row a step (and may draft)."""
    return seq.prefilled >= seq.prompt_len


def plan_step(active: Sequence[S], policy: Policy) -> list[Call[S]]:
    """The `llama_decode` calls of one step over `active` (in arrival order)."""
    rows = [s for s in active if decoding(s)]
    prompting = [s for s in active if not decoding(s)]
    if policy.deterministic:
        return _deterministic(rows, prompting, policy)
    call: Call[S] = Call(decodes=rows)
    budget = policy.step_tokens
    for seq in prompting:
        if budget == 0:
            break
        take = min(_chunk(seq.prompt_len - seq.prefilled, policy.chunk_tokens), budget)
        call.chunks.append(Chunk(seq, seq.prefilled, take))
        budget -= take
    return [call] if call.rows else []


def _chunk(left: int, cap: int) -> int:
    """One sequence's prompt tokens this step: `cap`, or all that is left where that is at most
    half a chunk more (a tail of a few tokens would cost a step of its own, a pass over the
    weights for little: a 275-token summary prompt stays one chunk)."""
    return left if left <= cap + cap // 2 else cap


def _deterministic(decoding: list[S], prompting: list[S], policy: Policy) -> list[Call[S]]:
    rows = policy.exact_rows
    calls: list[Call[S]] = [
        Call(decodes=decoding[i : i + rows]) for i in range(0, len(decoding), rows)
    ]
    if prompting:
        seq = prompting[0]
        # The chunk ends at the next multiple of step_tokens: the same cut as alone, even
        # when the prompt started mid-chunk for some reason (never, with the prefix cache off).
        end = min(seq.prompt_len, (seq.prefilled // policy.step_tokens + 1) * policy.step_tokens)
        calls.append(Call(chunks=[Chunk(seq, seq.prefilled, end - seq.prefilled)]))
    return calls


def split_by_adapter(calls: list[Call[S]], adapter: Callable[[S], Hashable]) -> list[Call[S]]:
    """Each call cut into one call per adapter set (in order of first appearance), keeping
    decodes before chunks and the order within each: llama.cpp computes a whole decode with
    the context's adapter set, so rows of different sets cannot share one."""
    out: list[Call[S]] = []
    for call in calls:
        groups: dict[Hashable, Call[S]] = {}
        for seq in call.decodes:
            groups.setdefault(adapter(seq), Call()).decodes.append(seq)
        for chunk in call.chunks:
            groups.setdefault(adapter(chunk.seq), Call()).chunks.append(chunk)
        out.extend(groups.values())
    return out
