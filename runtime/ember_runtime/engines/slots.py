"""The llama.cpp engine's slots (llama-server's): which seq_id each running request decodes on,
what a finished request leaves in its KV cells for the next one (the prefix cache), and the
device sampler chain attached to each seq_id. Decode thread only.

The prefix cache: a finished request's prompt stays in its seq_id's KV cells, and a new request
takes the free seq_id whose cached prompt shares the longest prefix with its own (a chat system
prompt, few-shot examples), decoding only the rest. It costs no memory (the pool holds
`contextLength x maxBatchSize` cells anyway) and is bounded by the number of sequences; an
entry is evicted only when its seq_id is needed by a request that shares nothing longer with
any other free seq_id — so the most useful prefixes survive. In the pool a running sequence's
prompt is shared too (a copy only tags cells with one more seq_id, `_share_live_prefix`), so a
burst with a new shared system prompt computes it once per step it arrives in; with
per-sequence streams (deterministic mode has the prefix cache off) a copy would move the whole
stream buffer.

LoRA adapters: KV cells computed under one adapter hold other numbers than the base's or
another adapter's, so a prefix is reused or shared only between requests of the same adapter
(`Sequence.adapter`, the adapter version's key; None is the base).

KV layout. In one pool (`kv_unified`, fast mode) any step is one micro-batch whatever its
seq_ids. With one stream per sequence (deterministic mode), llama.cpp cuts a batch into
micro-batches of consecutive seq_ids taking the same number of tokens from each
(`split_equal`), each a full pass over the weights, so running sequences are kept on seq_ids
0..n-1 (`compact`; this changes no numbers).
"""

from __future__ import annotations

from ember_runtime.engines import device_sampling
from ember_runtime.engines.adapters import LoadedAdapter
from ember_runtime.engines.base import SamplingParams
from ember_runtime.engines.device_sampling import DeviceChain
from ember_runtime.engines.grammar_mask import Grammar
from ember_runtime.engines.llama_native import LlamaContext
from ember_runtime.engines.sampling import RowSampler
from ember_runtime.engines.speculative import Speculator
from ember_runtime.engines.stream import Stream
from ember_runtime.engines.text import TextAssembler


class Sequence:
    """The decode-thread side of one request: its prompt, how far it has got, its samplers."""

    __slots__ = (
        "chain",
        "draft",
        "generated",
        "grammar",
        "last_token",
        "lora",
        "params",
        "prefilled",
        "prompt",
        "sampler",
        "seq_id",
        "spec",
        "stream",
        "text",
    )

    def __init__(
        self,
        stream: Stream,
        prompt: list[int],
        params: SamplingParams,
        sampler: RowSampler,
        grammar: Grammar | None,
    ) -> None:
        self.stream = stream
        self.prompt = prompt
        self.params = params
        self.text = TextAssembler(params.stop)
        self.seq_id = -1
        self.prefilled = 0  # prompt tokens already submitted
        self.generated = 0
        self.last_token = -1
        self.sampler = sampler
        self.grammar = grammar  # freed with the sequence
        self.chain: DeviceChain | None = None  # sampled inside llama_decode (set at admission)
        # The adapter version it was submitted for (engine-bound; kept while it runs even if
        # the adapter is removed or re-pointed meanwhile).
        self.lora: LoadedAdapter | None = None
        # Speculative decoding (engines/speculative.py): its drafter, from the first token on
        # where the request may draft, and this step's draft (decoded after its last token).
        self.spec: Speculator | None = None
        self.draft: list[int] = []

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def adapter(self) -> str | None:
        """The LoRA adapter this sequence's KV cells are computed with (None: the base): the
        bound version's key when bound (a name re-pointed at other bytes is another adapter)."""
        return self.lora.key if self.lora is not None else self.params.adapter

    def drop_sampler(self) -> None:
        """Free the grammar; the device chain stays with the seq_id for the next request."""
        self.chain = None
        if self.grammar is not None:
            self.grammar.free()
            self.grammar = None


class Slots:
    """The seq_ids of one context: the running sequences on them, the free ones (least recently
    used first) with the prompt each still caches, and each seq_id's device chain."""

    def __init__(
        self, native: LlamaContext, capacity: int, *, prefix_cache: bool, unified: bool
    ) -> None:
        self._native = native
        self._prefix_cache = prefix_cache
        self._unified = unified
        self.running: list[Sequence] = []
        self._free_ids = list(range(capacity))  # least recently used first
        self._cached: list[list[int]] = [[] for _ in range(capacity)]
        self._cached_adapter: list[str | None] = [None] * capacity  # what computed _cached
        self._freed_at = [0] * capacity  # the step each seq_id was last released at
        self._chains: dict[int, DeviceChain] = {}  # attached to each seq_id (they stay)
        self.on_device = False  # resolved at load: is there a device to sample on?

    @property
    def free(self) -> int:
        """Seq_ids no request runs on."""
        return len(self._free_ids)

    def computing(self, prompt: list[int], adapter: str | None = None) -> bool:
        """Whether a running request is still computing this very prompt, which a new one would
        share once it is in the pool (only where sharing happens)."""
        if not (self._unified and self._prefix_cache):
            return False  # nothing would be shared: no reason to wait
        return any(
            r.prefilled < len(r.prompt) and r.prompt == prompt and r.adapter == adapter
            for r in self.running
        )

    def admit(self, seq: Sequence) -> None:
        """Put `seq` on a free seq_id, reusing what its KV cells hold of the prompt."""
        seq.seq_id, seq.prefilled = self._pick(seq.prompt, seq.adapter)
        seq.chain = self._chain_for(seq.seq_id, seq.params)
        self.running.append(seq)

    def release(self, seq: Sequence, step: int) -> None:
        """Leave the batch: clear the generated tokens' KV cells and return the seq_id.

        With the prefix cache on, the prompt's cells stay as a reusable prefix for the next
        request placed on this seq_id (cleared there if the next prompt differs); off, the
        sequence's cells are cleared entirely.
        """
        sid = seq.seq_id
        if sid < 0:
            return
        kept = seq.prefilled if self._prefix_cache else 0
        if kept == 0 or not self._native.forget(sid, kept):
            self._native.forget(sid)
            kept = 0
        self._cached[sid] = seq.prompt[:kept]
        self._cached_adapter[sid] = seq.adapter
        seq.drop_sampler()
        self._free_ids.append(sid)
        self._freed_at[sid] = step
        seq.seq_id = -1
        self.running.remove(seq)

    def close(self, step: int) -> None:
        """Release every running sequence and free the device chains (before the context)."""
        for seq in list(self.running):  # release removes it from running
            self.release(seq, step)
        for chain in self._chains.values():
            chain.free(self._native.ctx)
        self._chains.clear()

    def _pick(self, prompt: list[int], adapter: str | None) -> tuple[int, int]:
        """A free seq_id, preferring the one whose cached prompt shares the longest prefix.

        Returns (seq_id, tokens already in its KV cache). At least the last prompt token is
        always decoded again, because sampling needs its logits.
        """
        best, best_len = 0, -1
        for i, sid in enumerate(self._free_ids):
            same = self._cached_adapter[sid] == adapter  # else its cells are other numbers
            common = _common_prefix(self._cached[sid], prompt) if same else 0
            # Ties go to the lowest seq_id: the running set then stays on 0..n-1 (see compact).
            if common > best_len or (common == best_len and sid < self._free_ids[best]):
                best, best_len = i, common
        sid = self._free_ids.pop(best)
        keep = min(best_len, len(prompt) - 1)
        if keep <= 0 or not self._native.forget(sid, keep):
            self._native.forget(sid)
            keep = 0
        self._cached[sid] = []
        if self._unified and self._prefix_cache:
            keep = max(keep, self._share_live_prefix(sid, prompt, keep, adapter))
        return sid, keep

    def _share_live_prefix(
        self, sid: int, prompt: list[int], have: int, adapter: str | None
    ) -> int:
        """Unified KV only: let `sid` share the computed prompt cells of a running sequence
        that has a longer common prefix than `have` (one pool: a copy only tags the cells
        with one more seq_id, no data moves). Returns the tokens now cached, or 0."""
        donor, shared = None, have
        for seq in self.running:
            if seq.adapter != adapter:
                continue  # cells computed under another adapter set
            common = _common_prefix(seq.prompt[: seq.prefilled], prompt)
            if common > shared:
                donor, shared = seq, common
        shared = min(shared, len(prompt) - 1)
        if donor is None or shared <= have:
            return 0
        self._native.forget(sid)
        self._native.copy(donor.seq_id, sid, 0, shared)
        return shared

    def _chain_for(self, sid: int, params: SamplingParams) -> DeviceChain | None:
        """The device chain that samples `sid`'s next request: the one already attached when
        it computes the same (no rebuild), else a new one; None: the host samples it (then no
        chain may stay attached, or llama.cpp would not copy this row's logits out)."""
        ctx = self._native.ctx
        held = self._chains.get(sid)
        want = self.on_device and device_sampling.eligible(params)
        key = device_sampling.reuse_key(params)
        if want and held is not None and key is not None and held.key == key:
            return held
        if held is not None:
            held.free(ctx)
            del self._chains[sid]
        if not want:
            return None
        chain = DeviceChain(self._native.ll, self._native.vocab.size, params)
        if not chain.attach(ctx, sid):  # this backend lacks an op: the host samples
            chain.free(ctx)
            return None
        self._chains[sid] = chain
        return chain

    def compact(self, step: int) -> None:
        """Keep the running sequences on seq_ids 0..n-1.

        With one KV stream per sequence, llama.cpp cuts a batch into ubatches of *consecutive*
        seq_ids (`split_equal(sequential=true)`), and every ubatch is a full pass over the
        weights: running seq_ids {0, 2, 5} would cost three passes per step instead of one.
        A sequence above n moves into a hole below n: llama.cpp copies the whole stream buffer
        (cells keep their indices and positions, so the numbers do not change) at the start
        of the next decode, a few MB once per finished request.
        """
        if self._unified:
            return  # one stream: any seq_ids go in one micro-batch, nothing to move
        n = len(self.running)
        # With the prefix cache, a just-freed seq_id holds a prompt that its client's next
        # request is likely to repeat within a step or two: let it be reused before filling it.
        settled = step - (2 if self._prefix_cache else 0)
        holes = sorted(
            (sid for sid in self._free_ids if sid < n and self._freed_at[sid] <= settled),
            reverse=True,
        )
        for seq in self.running:
            if seq.seq_id >= n and holes:
                self._move(seq, holes.pop())

    def _move(self, seq: Sequence, dst: int) -> None:
        ctx, src = self._native.ctx, seq.seq_id
        self._native.copy(src, dst)  # cross-stream: a deferred buffer copy
        self._native.forget(src)
        if dst in self._chains:
            self._chains.pop(dst).free(ctx)
        if seq.chain is not None:
            del self._chains[src]
            if seq.chain.move(ctx, dst):
                self._chains[dst] = seq.chain
            else:  # cannot happen: it ran on this device before
                seq.chain.free(ctx)
                seq.chain = None
        self._free_ids.remove(dst)
        self._free_ids.append(src)
        self._cached[dst] = []  # its cached prefix (if any) was just overwritten
        self._cached[src] = []
        seq.seq_id = dst


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
