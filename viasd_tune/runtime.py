"""Serving a tuned profile: ``load(profile)`` rebuilds the decoder the search chose and checks that the
models are the ones the profile was tuned on. A routed profile gives a :class:`RoutedDecoder`: one decoder per
configuration on the same loaded models, and the profile's rule picks one per request."""

from __future__ import annotations

import logging
import os
import warnings

from . import models
from .config import DecodeConfig
from .decoding.common import Result
from .decoding.decoder import Decoder, StreamEnd, TextStream
from .errors import UserError
from .profile import configuration_profile, load_profile
from .rule import apply_rule, prompt_features

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


class HostMismatchWarning(UserWarning):
    """The profile is served on another matrix ISA or device than it was tuned on: its tuned speed may not hold."""


def check_host(prof: dict, device: str, strict_host: bool) -> None:
    """Warn in one line (refuse with ``strict_host``) when this host's matrix ISA or device is not the one the
    profile was tuned on: a bf16 verify block costs about one step with AMX and 3.3 without native bf16, so the
    search's choice may not be the fastest here (shared/NOTES.md). A profile that does not record its ISA is
    only checked for its device."""
    from .host import matrix_isa

    tuned_isa = prof.get("provenance", {}).get("matrix_isa") or "unknown"
    here_isa = matrix_isa(device)
    here_device = models.torch.device(device).type
    diff = []
    if prof["device"] != here_device:
        diff.append(f"device {prof['device']}, served on {here_device}")
    if tuned_isa != "unknown" and tuned_isa != here_isa:
        diff.append(f"matrix ISA {tuned_isa}, this host has {here_isa}")
    if not diff:
        return
    msg = (
        f"the profile was tuned on {' and '.join(diff)}: its tuned speed is not expected to hold here; "
        "re-run the search on this host"
    )
    if strict_host:
        raise UserError(msg + " (or serve it without strict_host / --strict-host)")
    warnings.warn(msg, HostMismatchWarning, stacklevel=3)


class RoutedStream:
    """A configuration's :class:`TextStream` whose :class:`StreamEnd` names the configuration."""

    def __init__(self, stream: TextStream, name: str):
        self.stream, self.name = stream, name

    def __iter__(self) -> RoutedStream:
        return self

    def __next__(self) -> str | StreamEnd:
        item = next(self.stream)
        if isinstance(item, StreamEnd):
            item.result.stats.routed_to = self.name
        return item

    def cancel(self) -> None:
        self.stream.cancel()

    def close(self) -> None:
        self.stream.close()


class RoutedDecoder:
    """The decoders of a routed profile's configurations and the rule that picks one per request.

    They share the target (and draft) model: a configuration's skip sets are passed to every forward, never
    stored on the model, and ``install_skipping`` is idempotent, so several decoders on one model are safe."""

    def __init__(self, decoders: list[Decoder], names: list[str], rule: dict):
        self.decoders, self.names, self.rule = decoders, names, rule
        self.tokenizer = decoders[0].tokenizer

    def forget(self) -> None:
        """:meth:`Decoder.forget` on every configuration."""
        for decoder in self.decoders:
            decoder.forget()

    def route(self, ids, category: str | None = None) -> int:
        """Index of the configuration that serves a prompt (token ids) of this category."""
        return apply_rule(self.rule, prompt_features(ids, category))

    def generate(self, prompt, *args, category: str | None = None, **kwargs) -> Result:
        """:meth:`Decoder.generate` on the configuration the rule picks; ``category`` (e.g. ``qa``) is the
        caller's task category where it knows one. ``stats.routed_to`` names the configuration."""
        ids = self.decoders[0].prompt_ids(
            prompt, kwargs.pop("chat", "auto")
        )  # host ids: features need no sync
        k = self.route(ids, category)
        result = self.decoders[k].generate(ids, *args, **kwargs)
        result.stats.routed_to = self.names[k]
        return result

    def stream(self, prompt, *args, category: str | None = None, **kwargs) -> RoutedStream:
        """:meth:`Decoder.stream` on the configuration the rule picks; the :class:`StreamEnd`'s
        ``result.stats.routed_to`` names it. Bad input raises here, before anything decodes."""
        ids = self.decoders[0].prompt_ids(prompt, kwargs.pop("chat", "auto"))
        k = self.route(ids, category)
        return RoutedStream(self.decoders[k].stream(ids, *args, **kwargs), self.names[k])

    def config_of(self, result: Result) -> DecodeConfig:
        """The configuration that produced ``result``."""
        return self.decoders[self.names.index(result.stats.routed_to)].config


def load(
    profile,
    model=None,
    draft=None,
    device: str | None = None,
    dtype: str | None = None,
    strict: bool = True,
    strict_host: bool = False,
) -> Decoder | RoutedDecoder:
    """Rebuild the tuned decoder. ``profile``: path or dict. ``model``/``draft``: a name/path to load instead
    of the profile's, or an already loaded :class:`models.LoadedModel`. A routed profile (``routes``) gives a
    :class:`RoutedDecoder` whose configurations share the models. ``strict``: refuse models whose fingerprint
    differs from the profile's (else warn); ``strict_host``: refuse a host whose matrix ISA or device differs
    from the one the profile was tuned on (else warn, :class:`HostMismatchWarning`)."""
    prof = load_profile(profile if isinstance(profile, dict) else os.fspath(profile))
    if "routes" in prof:
        singles = [configuration_profile(prof, k) for k in range(len(prof["routes"]["configurations"]))]
    else:
        singles = [prof]
    configs = [DecodeConfig.from_profile(p) for p in singles]
    uses_draft = any(c.model_drafter == "model" and c.mode != "ar" for c in configs)
    for p, config in zip(singles, configs, strict=True):
        # Checked against the fingerprints' layer counts before any model loads (and by the decoder once they have).
        draft_layers = p["draft"]["fingerprint"]["num_layers"] if config.model_drafter == "model" else None
        config.validate(p["target"]["fingerprint"]["num_layers"], draft_layers)
    dtype = dtype or prof["dtype"]
    device = device or ("cuda" if prof["device"] == "cuda" and models.torch.cuda.is_available() else "cpu")
    if isinstance(model, models.LoadedModel):
        device = str(model.model.device)
    check_host(prof, str(models.resolve_device(device)), strict_host)  # before any model loads

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
    if uses_draft:
        draft_lm = get(draft, prof["draft"], "draft")
        models.check_same_tokenizer(target, draft_lm)
    decoders = [
        Decoder(target.model, target.tokenizer, c, draft=draft_lm.model if draft_lm else None)
        for c in configs
    ]
    if "routes" not in prof:
        return decoders[0]
    names = [c["name"] for c in prof["routes"]["configurations"]]
    return RoutedDecoder(decoders, names, prof["routes"]["rule"])
