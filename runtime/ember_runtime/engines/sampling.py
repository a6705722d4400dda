"""Token choice and log-probabilities from one logits row (numpy; no model needed to test).

Greedy decoding takes the argmax in numpy: llama.cpp's greedy sampler would first copy all
262k candidates of Gemma's vocabulary into a token-data array, for every token. Anything else
(temperature, top_p, a grammar) goes through a llama.cpp sampler chain built by the engine.
"""

from __future__ import annotations

import numpy as np


def greedy(row: np.ndarray) -> int:
    return int(row.argmax())


def logprobs(row: np.ndarray, chosen: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """log softmax(row)[chosen] and the `top` most likely (token, logprob), best first.

    Computed from the raw logits: what the model thinks, before temperature, top_p or a
    grammar reshaped the distribution (OpenAI reports the same).
    """
    peak = float(row.max())
    norm = peak + float(np.log(np.exp(row.astype(np.float64) - peak).sum()))
    best: list[tuple[int, float]] = []
    if top > 0:
        k = min(top, row.shape[0])
        idx = np.argpartition(row, -k)[-k:]
        idx = idx[np.argsort(row[idx])[::-1]]
        best = [(int(i), float(row[i]) - norm) for i in idx]
    return float(row[chosen]) - norm, best
