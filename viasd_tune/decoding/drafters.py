"""Draft sources: a separate draft model, the target's own self-draft (many sub-layers skipped), and prompt
lookup. Each proposes up to γ tokens and the logits it drew them from (``None`` for a one-hot proposal)."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from ..routing import SkipSet
from .common import CachedLM, Sampling, Stats, pick


class Drafter(Protocol):
    kind: str

    def draft(self, seq: torch.Tensor, gamma: int) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def rollback(self, length: int) -> None: ...


class ModelDrafter:
    """Autoregressive drafting with a causal LM (a separate model, or the target under a skip set)."""

    def __init__(
        self,
        model: nn.Module,
        sampling: Sampling,
        gen: torch.Generator | None,
        stats: Stats,
        skip: SkipSet | None = None,
    ):
        self.kind = "self" if skip is not None else "model"
        self.lm = CachedLM(model, skip, tier="draft", stats=stats)
        self.sampling = sampling
        self.gen = gen

    def draft(self, seq: torch.Tensor, gamma: int) -> tuple[torch.Tensor, torch.Tensor]:
        """γ tokens and the logits each was drawn from; the last token is not fed back (gpt-fast does the same)."""
        tokens, logits = [], []
        ids = seq
        for _ in range(gamma):
            last = self.lm.forward(ids, keep=1)[-1]
            tok = pick(last, self.sampling, self.gen)
            tokens.append(tok)
            logits.append(last)
            ids = torch.cat([ids, tok.view(1)])
        self.lm.stats.drafted += gamma
        return torch.stack(tokens), torch.stack(logits)

    def rollback(self, length: int) -> None:
        self.lm.rollback(length)


class LookupDrafter:
    """Prompt-lookup drafting: find the latest earlier occurrence of the context's last n-gram (n from
    ``max_ngram`` down to 1) and propose the tokens that followed it. No model call; a one-hot proposal."""

    kind = "lookup"

    def __init__(self, stats: Stats, max_ngram: int = 3):
        self.stats = stats
        self.max_ngram = max_ngram

    def draft(self, seq: torch.Tensor, gamma: int) -> tuple[torch.Tensor, None]:
        n_tok = seq.numel()
        for n in range(min(self.max_ngram, n_tok - 1), 0, -1):
            windows = seq.unfold(0, n, 1)[:-1]  # every n-gram that has a successor
            hits = (windows == seq[-n:]).all(-1).nonzero()
            if hits.numel():
                start = int(hits[-1]) + n
                proposal = seq[start : start + gamma]
                self.stats.drafted += proposal.numel()
                return proposal, None
        return seq[:0], None

    def rollback(self, length: int) -> None:
        pass
