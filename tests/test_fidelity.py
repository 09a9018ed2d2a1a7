"""Fidelity measures: teacher-forced greedy agreement and position-wise agreement."""

from __future__ import annotations

import torch
from conftest import tiny_model

from viasd_tune.config import DecodeConfig
from viasd_tune.decoding.decoder import Decoder
from viasd_tune.fidelity import agreement, greedy_agreement


def test_greedy_agreement_counts_each_override_once():
    model = tiny_model("llama", seed=3)
    prompt = torch.tensor([5, 17, 9, 33, 2])
    out = Decoder(model, None, DecodeConfig(mode="ar")).generate(prompt, max_new_tokens=12).token_ids
    assert greedy_agreement(model, prompt, out) == 1.0  # the target's own greedy output
    logits = model(input_ids=torch.cat([prompt, torch.tensor(out)])[None]).logits[0]
    flipped = list(out)
    flipped[3] = int(logits[len(prompt) + 2].argsort()[-2])  # the runner-up: not the target's choice there
    # only the flipped token disagrees under its own prefix (the later tokens may or may not, so recompute)
    later = torch.cat([prompt, torch.tensor(flipped)])[None]
    choices = model(input_ids=later).logits[0, len(prompt) - 1 : -1].argmax(-1)
    expected = (choices == torch.tensor(flipped)).float().mean().item()
    assert greedy_agreement(model, prompt, flipped) == expected < 1.0
    assert choices[3] != flipped[3]
    assert greedy_agreement(model, prompt, []) == 1.0


def test_positional_agreement_counts_the_longer_side():
    assert agreement([1, 2, 3], [1, 2, 3]) == 1.0
    assert agreement([1, 9, 3], [1, 2, 3]) == 2 / 3
    assert agreement([1, 2], [1, 2, 3, 4]) == 0.5
    assert agreement([], []) == 1.0
