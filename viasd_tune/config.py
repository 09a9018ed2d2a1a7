"""The decoding configuration: everything a profile pins about decoding, except the models themselves."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .errors import UserError
from .routing import SkipSet

MODES = ("ar", "sd", "viasd")
DRAFTERS = ("model", "self", "lookup")
KL_KINDS = ("forward", "reverse", "js")


@dataclass(frozen=True)
class DecodeConfig:
    """Everything a profile pins about decoding, except the models themselves."""

    mode: str = "viasd"
    gamma: int = 5
    drafter: str = "model"
    skip: SkipSet = field(default_factory=SkipSet)  # the slim verifier's
    draft_skip: SkipSet = field(default_factory=SkipSet)  # the self-draft's (drafter == "self")
    tau_accept: float = 0.0
    tau_escalate: float = 0.0
    kl: str = "forward"
    recheck: bool = False  # the full target re-checks slim-settled tokens in its next pass: lossless VIA-SD
    draft_confidence: float = 0.0  # stop drafting after a pick below this probability (0: always γ)

    def validate(self, n_layers: int, has_draft_model: bool) -> DecodeConfig:
        if self.mode not in MODES:
            raise UserError(f"unknown mode {self.mode!r}; use one of {', '.join(MODES)}")
        if self.mode == "ar":
            return self
        if self.gamma < 1:
            raise UserError(
                f"gamma must be at least 1 (got {self.gamma}); it is the number of drafted tokens per round"
            )
        if self.drafter not in DRAFTERS:
            raise UserError(f"unknown drafter {self.drafter!r}; use one of {', '.join(DRAFTERS)}")
        if self.drafter == "model" and not has_draft_model:
            raise UserError(
                "drafter 'model' needs a draft model; pass --draft, or use --draft-skip (self) or lookup"
            )
        if self.drafter == "self":
            if self.draft_skip.is_empty:
                raise UserError("the self-draft needs a skip set; pass --draft-skip-attn/--draft-skip-mlp")
            self.draft_skip.validate(n_layers)
        if self.mode == "viasd":
            if self.kl not in KL_KINDS:
                raise UserError(f"unknown --kl {self.kl!r}; use one of {', '.join(KL_KINDS)}")
            if self.tau_accept < 0 or self.tau_escalate < 0:
                raise UserError("thresholds must be >= 0 (tau_accept and tau_escalate)")
            if self.tau_accept > self.tau_escalate:
                raise UserError(
                    f"tau_accept ({self.tau_accept}) is above tau_escalate ({self.tau_escalate}); "
                    "tau_accept must be <= tau_escalate"
                )
            self.skip.validate(n_layers)
        return self

    def to_dict(self) -> dict:
        d = asdict(self)
        d["skip"] = self.skip.to_dict()
        d["draft_skip"] = self.draft_skip.to_dict()
        return d


