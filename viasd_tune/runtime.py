"""Serving a tuned profile: ``load(profile)`` rebuilds the decoder the search chose and checks that the
models are the ones the profile was tuned on."""

from __future__ import annotations

import logging
import os
import warnings

from . import models
from .config import DecodeConfig
from .decoding.decoder import Decoder
from .errors import UserError
from .profile import load_profile

log = logging.getLogger(__name__)
# Fields that identify the weights; the source path may legitimately differ between machines.
_PINNED = ("architecture", "num_layers", "hidden_size", "vocab_size", "vocab_sha256")


def check_fingerprint(role: str, expected: dict, actual: dict, strict: bool) -> None:
    """Refuse (or warn about) a model whose weights differ from the ones the profile was tuned on."""
    diff = [k for k in _PINNED if expected.get(k) != actual.get(k)]
    sha_e, sha_a = expected.get("source", {}).get("sha256"), actual.get("source", {}).get("sha256")
    if sha_e and sha_a and sha_e != sha_a:
        diff.append("weights sha256")
    if not diff:
        return
    msg = (
        f"the {role} model does not match the profile's fingerprint ({', '.join(diff)} differ); "
        "load the model the profile was tuned on (--model/--draft name it on the command line); "
        "only from Python, runtime.load(..., strict=False) uses another one anyway"
    )
    if strict:
        raise UserError(msg)
    warnings.warn(msg, stacklevel=3)


def load(
    profile, model=None, draft=None, device: str | None = None, dtype: str | None = None, strict: bool = True
) -> Decoder:
    """Rebuild the tuned decoder. ``profile``: path or dict. ``model``/``draft``: a name/path to load instead
    of the profile's, or an already loaded :class:`models.LoadedModel`."""
    prof = load_profile(profile if isinstance(profile, dict) else os.fspath(profile))
    config = DecodeConfig.from_profile(prof)
    # Checked against the fingerprints' layer counts before any model loads (and by the decoder once they have).
    draft_layers = prof["draft"]["fingerprint"]["num_layers"] if config.model_drafter == "model" else None
    config.validate(prof["target"]["fingerprint"]["num_layers"], draft_layers)
    dtype = dtype or prof["dtype"]
    device = device or ("cuda" if prof["device"] == "cuda" and models.torch.cuda.is_available() else "cpu")

    def get(given, entry: dict, role: str) -> models.LoadedModel:
        lm = (
            given
            if isinstance(given, models.LoadedModel)
            else models.load(given or entry["name"], dtype, device)
        )
        check_fingerprint(role, entry["fingerprint"], lm.fingerprint, strict)
        return lm

    target = get(model, prof["target"], "target")
    draft_lm = None
    if config.model_drafter == "model" and config.mode != "ar":
        draft_lm = get(draft, prof["draft"], "draft")
        models.check_same_tokenizer(target, draft_lm)
    return Decoder(target.model, target.tokenizer, config, draft=draft_lm.model if draft_lm else None)
