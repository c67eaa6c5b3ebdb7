"""Text from a character-level language model's checkpoint (``raysinga generate``).

The model sees a fixed context of ``T`` positions (its ``input_shape``). Every layer of a
sequence model here is causal (attention is masked, recurrent layers run forward, the rest act
per position), so the output at position ``i`` depends on positions ``0..i`` only: the last
``T`` characters go in from position 0, whatever follows them is ignored, and the next character
is drawn from the output at the last character's position.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from raysinga.checkpoint import Checkpoint, CheckpointError
from raysinga.data.text import Vocabulary
from raysinga.nn.layers import StepContext
from raysinga.nn.model import Net, recorded_spec


def language_model(ck: Checkpoint) -> tuple[Net, dict[str, Any], Vocabulary]:
    """The net, its parameters and the vocabulary of a checkpoint of a model trained on the
    text corpus (its vocabulary is fixed: no corpus is read); CheckpointError for any other
    checkpoint."""
    run = ck.meta.get("run", {})
    source = run.get("config", {}).get("data", {}).get("source", {})
    spec = recorded_spec(run, f"checkpoint {ck.location}") if "model" in run else None
    if spec is None or spec.loss != "sequence_cross_entropy" or source.get("kind") != "text":
        raise CheckpointError(
            f"{ck.location}: not a language model of the text corpus (generate needs a model "
            "with loss sequence_cross_entropy trained on data.source kind text)"
        )
    params = ck.arrays("param")
    net = Net(spec, dtype=str(next(iter(params.values())).dtype))
    vocab = Vocabulary()
    if net.output_shape[-1] != len(vocab):
        raise CheckpointError(
            f"{ck.location}: the model predicts {net.output_shape[-1]} tokens, the text "
            f"corpus has {len(vocab)}"
        )
    return net, params, vocab


def generate(
    ck: Checkpoint, prompt: str, length: int, temperature: float = 1.0, seed: int = 0
) -> str:
    """``prompt`` followed by ``length`` characters drawn one at a time from the model's
    distribution at ``temperature`` (0: always the likeliest), with the generator ``seed``."""
    if length < 0:
        raise ValueError(f"--length must be at least 0, got {length}")
    if temperature < 0:
        raise ValueError(f"--temperature must be at least 0, got {temperature}")
    net, params, vocab = language_model(ck)
    state = ck.arrays("state")
    t = net.spec.input_shape[0]
    rng = np.random.default_rng(seed)
    tokens = list(vocab.encode(prompt)) or list(vocab.encode("\n"))  # something to go on
    start = len(tokens)
    x = np.zeros((1, t), np.int64)
    ctx = StepContext(train=False)
    for _ in range(length):
        window = tokens[-t:]
        x[0, : len(window)] = window
        logits = net.forward(params, state, x, ctx)[0, len(window) - 1].astype(np.float64)
        if temperature == 0:
            tokens.append(int(logits.argmax()))
            continue
        z = logits / temperature
        p = np.exp(z - z.max())
        tokens.append(int(rng.choice(len(p), p=p / p.sum())))
    return prompt + vocab.decode(np.array(tokens[start:], np.int64))
