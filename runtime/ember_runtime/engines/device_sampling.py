"""Sampling inside `llama_decode`: llama.cpp's backend samplers, one chain per sequence.

On a GPU the host sampler (`sampling.py`) costs a logits copy per row (4 bytes x 128k-262k
tokens) and numpy passes over it on the decode thread; llama.cpp can instead run the chain in
the decode's own graph on the device and hand back only the token (llama-server's
`--backend-sampling`). A sequence gets a chain here when every stage it needs exists on the
device with the same meaning as the host sampler's, in the same order:

    logit bias → top_k → top_p → min_p → temperature → draw   (greedy: bias → argmax)

Penalties (their window needs the prompt tokens accepted on the host), typical_p, a grammar,
`ignore_eos`, `min_keep` above 1 and logprobs (they read the raw row) stay on the host path.
A chain the device cannot run (`llama_set_sampler` refuses it) falls back to the host too.

Chains stay attached. Attaching or detaching one makes llama.cpp rebuild its scheduler and
worst-case graphs before the next decode (`sched_reserve`) and drops the reused graph; done
per request, as llama-server does, that is one rebuild per step at 64 clients. A chain whose
request finished stays on its seq_id, and the next request there with the same parameters
(and no seed: a seed needs a fresh RNG) takes it over: in a steady stream of requests that
sample alike nothing is rebuilt.

Exactness: each device stage computes what its host twin does (top_p sorts the row and keeps
the prefix whose cumulative probability first reaches p; min_p keeps l > l_max + ln p;
temperature divides the kept logits; the draw inverts the CDF), in float32 where the host uses
float64: a token on a boundary may differ in a last-bit tie. The chi-square tests run both
paths against one float64 reference (tests/runtime/test_sampling_model.py).
Seeds: the device draw uses llama.cpp's RNG (one per sequence, seeded from the request), so a
seed repeats its tokens on the same path, not across paths.
"""

from __future__ import annotations

import enum
from typing import Any

from ember_runtime.engines.base import SamplingParams

_SEED_SPACE = 0xFFFFFFFF  # llama.cpp's seeds are uint32; this value means "random"


class DeviceSampling(enum.StrEnum):
    """`engine.deviceSampling`: where eligible requests are sampled."""

    AUTO = "auto"  # on when layers are offloaded to a GPU, else off
    ON = "on"  # every eligible request, on whatever backend holds the output (tests: CPU)
    OFF = "off"  # the host sampler for every request


def resolve(mode: DeviceSampling, *, offloaded: bool, deterministic: bool) -> bool:
    """Whether this engine samples eligible requests on the device.

    `auto` keeps deterministic mode on the host: that mode is for CPU boxes, where the host
    sampler is as fast. `on` means on, deterministic or not (the chi-square tests use it: a
    device chain draws from bit-identical logits there just as the host does)."""
    if mode is DeviceSampling.AUTO:
        return offloaded and not deterministic
    return mode is DeviceSampling.ON


def eligible(params: SamplingParams) -> bool:
    """Every stage this request needs exists on the device with the host's meaning."""
    return (
        params.logprobs is None
        and params.grammar is None
        and not params.penalized
        and params.typical_p >= 1.0
        and params.min_keep <= 1
        and not params.ignore_eos
    )


class DeviceChain:
    """One sequence's llama.cpp sampler chain, attached to its seq_id while it decodes."""

    __slots__ = ("_chain", "_ll", "_seq_id", "key")

    def __init__(self, ll: Any, n_vocab: int, params: SamplingParams) -> None:
        self._ll = ll
        self._seq_id = -1
        self.key = reuse_key(params)
        self._chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        for stage in _stages(ll, n_vocab, params):
            ll.llama_sampler_chain_add(self._chain, stage)  # the chain owns it now

    def attach(self, ctx: Any, seq_id: int) -> bool:
        """Run this chain in every decode that outputs a row for `seq_id`; False when the
        device cannot (the caller samples on the host)."""
        if not self._ll.llama_set_sampler(ctx, seq_id, self._chain):
            return False
        self._seq_id = seq_id
        return True

    def move(self, ctx: Any, seq_id: int) -> bool:
        """Follow the sequence to another seq_id. A chain's device state is bound to one
        attachment, so a clone (its RNG state included: a seed's draws go on unchanged)
        takes its place."""
        clone = self._ll.llama_sampler_clone(self._chain)
        self.free(ctx)
        self._chain = clone
        return self.attach(ctx, seq_id)

    def detach(self, ctx: Any) -> None:
        if self._seq_id >= 0:
            self._ll.llama_set_sampler(ctx, self._seq_id, None)
            self._seq_id = -1

    def token(self, ctx: Any, row: int) -> int:
        """The token the last decode drew for output `row` (-1: none was drawn)."""
        return int(self._ll.llama_get_sampled_token_ith(ctx, row))

    def accept(self, tok: int) -> None:
        self._ll.llama_sampler_accept(self._chain, tok)

    def free(self, ctx: Any) -> None:
        self.detach(ctx)
        if self._chain:
            self._ll.llama_sampler_free(self._chain)
            self._chain = None


def reuse_key(params: SamplingParams) -> tuple[object, ...] | None:
    """What a chain computes; None when it cannot serve another request (a seed)."""
    if params.seed is not None:
        return None
    if params.greedy:
        return ("greedy", params.logit_bias)
    return (params.temperature, params.top_k, params.top_p, params.min_p, params.logit_bias)


def _stages(ll: Any, n_vocab: int, params: SamplingParams) -> list[Any]:
    stages = []
    if params.logit_bias:
        arr = (ll.llama_logit_bias * len(params.logit_bias))(
            *(ll.llama_logit_bias(token=t, bias=b) for t, b in params.logit_bias)
        )
        stages.append(ll.llama_sampler_init_logit_bias(n_vocab, len(arr), arr))
    if params.greedy:
        return [*stages, ll.llama_sampler_init_greedy()]
    if 0 < params.top_k < n_vocab:
        stages.append(ll.llama_sampler_init_top_k(params.top_k))
    if params.top_p < 1.0:
        stages.append(ll.llama_sampler_init_top_p(params.top_p, 1))
    if params.min_p > 0.0:
        stages.append(ll.llama_sampler_init_min_p(params.min_p, 1))
    seed = ll.LLAMA_DEFAULT_SEED if params.seed is None else params.seed % _SEED_SPACE
    stages.append(ll.llama_sampler_init_temp(params.temperature))
    return [*stages, ll.llama_sampler_init_dist(seed)]
