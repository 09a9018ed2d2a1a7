"""How faithful a (possibly lossy) decoder's output is to the target's own greedy decoding.

Two views, both reported:

- :func:`greedy_agreement` (the search's fidelity constraint): the share of emitted tokens that the target
  itself would have chosen given the same prefix, from one teacher-forced forward over prompt + output. It
  counts exactly the tokens a lossy tier decided against the target, each once.
- :func:`agreement` (positional) and exact match against the target's decoded greedy output. One early
  difference shifts every later position, so these punish a single flip as much as a wholly wrong answer.
  In bf16 even lossless SD flips near-ties (a k-token verify block and k single steps round differently):
  on SmolLM2-135M (12 Spec-Bench prompts, 48 tokens) plain SD scored 0.93 positional agreement with bf16 AR
  but 0.99 greedy agreement (both 1.0 in fp32), and a lossy prompt-lookup profile 0.59 against 0.97.
"""

from __future__ import annotations

import torch
from torch import nn


def agreement(out: list[int], ref: list[int]) -> float:
    """Share of positions where ``out`` equals the target's greedy output ``ref`` (over the longer of the two)."""
    n = max(len(out), len(ref))
    return sum(a == b for a, b in zip(out, ref, strict=False)) / n if n else 1.0


@torch.inference_mode()
def greedy_agreement(model: nn.Module, prompt_ids: torch.Tensor, output: list[int]) -> float:
    """Share of ``output`` tokens equal to the target's argmax given the prompt and the output before them."""
    if not output:
        return 1.0
    out = torch.tensor(output, dtype=torch.long, device=prompt_ids.device)
    full = torch.cat([prompt_ids.reshape(-1), out]).unsqueeze(0)
    logits = model(input_ids=full, logits_to_keep=len(output) + 1).logits[0, :-1]
    return (logits.argmax(-1) == out).float().mean().item()
