"""The one decoding configuration: what a profile, a search trial and the ``generate`` flags all describe.

:class:`DecodeConfig` is built in one place per source and validated where it is built:

- from flags or Python: ``DecodeConfig(mode=, gamma=, drafter=, skip=, draft_skip=, tau_accept=, tau_escalate=,
  kl=, recheck=, draft_confidence=, lookup_min=, tree_nodes=, tree_lookup_depth=, …)``;
- from a profile: :meth:`DecodeConfig.from_profile` (and back with :meth:`DecodeConfig.to_profile`);
- from an Optuna trial's params: ``search.params.suggest`` (it needs the search space);
- from the flat JSON record a trial keeps in its user attr ``config`` (and ``generate --json`` prints):
  :meth:`DecodeConfig.from_dict` / :meth:`DecodeConfig.to_dict`.

Every field is checked on construction (names, types, finite numbers in range, and that it has an effect in the
configuration's mode and drafter: the table :func:`applies` reads from each field's metadata), so a bad value is
refused before any model loads; :meth:`DecodeConfig.validate` adds the checks that need the models' layer counts.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from .errors import UserError
from .routing import SkipSet

MODES = ("ar", "sd", "viasd")
CHAIN_DRAFTERS = ("model", "self", "lookup", "lookup+model", "lookup+self")
# Drafters with token recycling (issue 33) run the tree round even as a chain (they learn from its logits).
RECYCLE_DRAFTERS = ("recycle", "lookup+recycle", "lookup+recycle+model")
DRAFTERS = CHAIN_DRAFTERS + RECYCLE_DRAFTERS
# The hybrids: prompt lookup first each round, the model drafter (a separate model or the self-draft) when it misses.
HYBRIDS = {"lookup+model": "model", "lookup+self": "self"}
KL_KINDS = ("forward", "reverse", "js")
SPECULATIVE = ("sd", "viasd")  # the modes that draft
GAMMA_MAX = 64  # drafted tokens per round; more only costs memory and time (a verify block is γ + 1 tokens)
TREE_NODES_MAX = 64  # draft nodes per tree (a verify block of 65 tokens costs ~3.5 steps on AVX-512-bf16)
# The tree fields, each a whole number from 1 to GAMMA_MAX; their flags are --tree-lookup-depth etc.
TREE_SOURCES = ("lookup", "recycle", "model")  # a tree drafter's sources, named by its parts
TREE_SIZINGS = ("fixed", "cost")  # the node budget every round, or each round cut to what pays on this host
TREE_SOURCE_FIELDS = tuple(f"tree_{source}_{what}" for source in TREE_SOURCES for what in ("depth", "width"))


def model_drafter(drafter: str) -> str | None:
    """The model-based drafter a drafter kind runs: ``model`` (a separate draft model) or ``self`` (the target under
    ``draft_skip``), alone or behind lookup / recycling; ``None`` for lookup and recycling alone."""
    parts = drafter.split("+")
    return "model" if "model" in parts else "self" if "self" in parts else None


_ROUTES = "the divergence and thresholds route tokens to the slim verifier"


def _whole_up_to_gamma_max(config: DecodeConfig, name: str, not_whole: str, out_of_range: str) -> None:
    """Check that the field ``name`` is a whole number (not a bool) from 1 to ``GAMMA_MAX``, and store it as an int.
    The two messages are the field's own: what it is and how to fix it."""
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise UserError(not_whole)
    if not 1 <= value <= GAMMA_MAX:
        raise UserError(out_of_range)
    object.__setattr__(config, name, int(value))


def _names(choices: tuple[str, ...]) -> str:
    return ", ".join(choices)


# ------------------------------------------------------------------------------------------- where a field applies
# Each field of DecodeConfig says in its metadata where it has an effect: the modes and drafters it applies to,
# its flags, and why. A field without metadata applies everywhere, so a new field is never refused by accident;
# one that does nothing somewhere says so in its own ``field(metadata=scope(...))``. The CLI, profiles, search
# spaces and the Python API all refuse a value that does nothing through :func:`check_applicable`.
MODEL_DRAFTERS = tuple(d for d in DRAFTERS if model_drafter(d))  # the drafters that run a model
LOOKUP_DRAFTERS = tuple(d for d in DRAFTERS if "lookup" in d.split("+"))  # a token tree's sources, by drafter
TREE_MODEL_DRAFTERS = tuple(d for d in DRAFTERS if "model" in d.split("+"))


def scope(
    flags: tuple[str, ...],
    modes: tuple[str, ...] = MODES,
    drafters: tuple[str, ...] = DRAFTERS,
    why: str = "",
    idle: tuple[Any, ...] = (),
) -> dict[str, Any]:
    """Field metadata: where the field has an effect. ``idle``: values besides the default that mean "not set"
    (they are never refused)."""
    return {"flags": flags, "modes": modes, "drafters": drafters, "why": why, "idle": idle}


def field_scope(f) -> dict[str, Any]:
    """A field's scope, its defaults filled in (a field without metadata applies everywhere)."""
    flag = "--" + f.name.replace("_", "-")
    return {**scope((flag,)), **dict(f.metadata)}


def applies(name: str, mode: str, drafter: str) -> bool:
    """Whether the field ``name`` has an effect in ``mode`` with ``drafter`` (in mode ``ar`` no drafter runs)."""
    sc = field_scope(next(f for f in fields(DecodeConfig) if f.name == name))
    return mode in sc["modes"] and (mode == "ar" or drafter in sc["drafters"])


def label(name: str) -> str:
    """How a message names a field: its name and its flags, e.g. ``skip (--skip-attn/--skip-mlp)``."""
    sc = field_scope(next(f for f in fields(DecodeConfig) if f.name == name))
    return f"{name} ({'/'.join(sc['flags'])})"


def where_applies(name: str, mode: str) -> str:
    """Where the field applies, for a message about ``mode``: ``"applies to mode viasd only (why)"``, or its
    drafters when ``mode`` is one of its modes."""
    sc = field_scope(next(f for f in fields(DecodeConfig) if f.name == name))
    where = (
        f"mode {'/'.join(sc['modes'])}" if mode not in sc["modes"] else f"drafter {'/'.join(sc['drafters'])}"
    )
    return f"{label(name)} applies to {where} only ({sc['why']})"


def check_applicable(mode: str, drafter: str, given: list[str]) -> None:
    """Refuse, in one line, the fields in ``given`` that do nothing in ``mode`` with ``drafter``, saying where
    each applies."""
    bad = [
        where_applies(f.name, mode)
        for f in fields(DecodeConfig)
        if f.name in given and not applies(f.name, mode, drafter)
    ]
    if bad:
        setting = f"mode {mode}" if mode == "ar" else f"mode {mode} with drafter {drafter}"
        raise UserError(
            f"{'these do' if len(bad) > 1 else 'this does'} nothing in {setting}: {'; '.join(bad)}; "
            f"drop {'them' if len(bad) > 1 else 'it'} or change the mode or drafter"
        )


@dataclass(frozen=True)
class DecodeConfig:
    """Everything a profile pins about decoding, except the models themselves.

    - ``mode``: ``ar`` (the target alone), ``sd`` (draft + full target, lossless) or ``viasd`` (three tiers);
    - ``gamma``: drafted tokens per round, 1..64 (the cap when ``draft_confidence`` stops drafting early);
    - ``drafter``: ``model`` (a separate draft model), ``self`` (the target with ``draft_skip`` skipped),
      ``lookup`` (prompt lookup, no model), or the hybrids ``lookup+model`` / ``lookup+self``: prompt lookup
      proposes first each round (it costs no forward) and the model drafter drafts when lookup finds fewer than
      ``lookup_min`` tokens;
    - ``skip``: the slim verifier's skip set (VIA-SD);
    - ``draft_skip``: the self-draft's skip set (``drafter == "self"``, layers of the target), or a skip set
      applied to the separate draft model (``drafter == "model"``, layers of the draft model); unused by lookup;
    - ``tau_accept`` <= ``tau_escalate``, finite and >= 0: the divergence thresholds (``tau_escalate = 0`` is
      plain SD, token for token);
    - ``kl``: the divergence, ``forward``, ``reverse`` or ``js``;
    - ``recheck``: VIA-SD only; the full target's next batched forward re-checks the tokens the slim tier
      settled and replaces any it disagrees with, which makes VIA-SD lossless;
    - ``draft_confidence``: in [0, 1); stop drafting once the drafter's top-1 probability falls below it
      (0: off, always draft ``gamma`` tokens);
    - ``lookup_min``: the hybrids only, 1..64; the shortest lookup proposal used as the round's drafts (capped
      at ``gamma``: a lookup of γ tokens is always used), shorter ones let the model drafter draft instead;
    - ``tree_nodes``: 0..64, the node budget of a token tree verified in one target forward (mode ``sd``);
      0 or 1 is a chain of γ drafts, today's round. With N > 1 the drafter's sources (``lookup``, ``recycle``:
      token recycling, ``model``: the draft model) each propose a tree no deeper than γ and the N best nodes
      are verified; drafters ``recycle``/``lookup+recycle``/``lookup+recycle+model`` also run as a chain (each
      source's top path, the first one at least ``lookup_min`` deep, as the hybrids do);
    - ``tree_sizing``: ``fixed`` verifies the budget's best nodes every round; ``cost`` cuts each round's tree to
      the size that maximises expected tokens per unit of this host's verify cost (measured when the decoder
      loads), with acceptance learnt from the rounds' verifications (``decoding/tree_sizing.py``);
    - ``tree_{lookup,recycle,model}_{depth,width}``: 1..64, each source's depth and branching (its top-k); the
      recycling table keeps ``tree_recycle_width`` successors per token.

    A value set where it has no effect (a skip set or ``recheck`` in mode ``sd``, ``draft_confidence`` with prompt
    lookup, ...) is refused: each field's metadata says where it applies (:func:`applies`, :func:`scope`).
    """

    mode: str = field(default="viasd", metadata=scope(("--mode",)))
    gamma: int = field(
        default=5,
        metadata=scope(("--gamma",), SPECULATIVE, why="the tokens drafted per round; ar drafts none"),
    )
    drafter: str = field(
        default="model",
        metadata=scope(("--drafter",), SPECULATIVE, why="ar drafts nothing", idle=("lookup",)),
    )
    skip: SkipSet = field(
        default_factory=SkipSet,
        metadata=scope(("--skip-attn", "--skip-mlp"), ("viasd",), why="the slim verifier's skip set"),
    )
    draft_skip: SkipSet = field(
        default_factory=SkipSet,
        metadata=scope(
            ("--draft-skip-attn", "--draft-skip-mlp"),
            SPECULATIVE,
            MODEL_DRAFTERS,
            why="the drafting model's skip set; prompt lookup runs no model",
        ),
    )
    tau_accept: float = field(default=0.0, metadata=scope(("--tau-accept",), ("viasd",), why=_ROUTES))
    tau_escalate: float = field(default=0.0, metadata=scope(("--tau-escalate",), ("viasd",), why=_ROUTES))
    kl: str = field(default="forward", metadata=scope(("--kl",), ("viasd",), why=_ROUTES))
    recheck: bool = field(
        default=False,
        metadata=scope(
            ("--recheck",), ("viasd",), why="the full target re-checks what the slim verifier settled"
        ),
    )
    draft_confidence: float = field(
        default=0.0,
        metadata=scope(
            ("--draft-confidence",),
            SPECULATIVE,
            MODEL_DRAFTERS,
            why="it stops a drafting model; prompt lookup has no confidence",
        ),
    )
    lookup_min: int = field(
        default=1,
        metadata=scope(
            ("--lookup-min",),
            SPECULATIVE,
            tuple(HYBRIDS) + RECYCLE_DRAFTERS,
            why="the shortest lookup proposal a hybrid or recycling drafter uses",
        ),
    )
    tree_nodes: int = field(
        default=1,
        metadata=scope(
            ("--tree-nodes",), ("sd",), why="the full target verifies token trees in mode sd", idle=(0,)
        ),
    )
    tree_sizing: str = field(
        default="fixed",
        metadata=scope(("--tree-sizing",), ("sd",), why="it sizes token trees, which mode sd verifies"),
    )
    tree_lookup_depth: int = field(
        default=8,
        metadata=scope(
            ("--tree-lookup-depth",), ("sd",), LOOKUP_DRAFTERS, why="the lookup source of a token tree"
        ),
    )
    tree_lookup_width: int = field(
        default=4,
        metadata=scope(
            ("--tree-lookup-width",), ("sd",), LOOKUP_DRAFTERS, why="the lookup source of a token tree"
        ),
    )
    tree_recycle_depth: int = field(
        default=4,
        metadata=scope(
            ("--tree-recycle-depth",), ("sd",), RECYCLE_DRAFTERS, why="the recycle source of a token tree"
        ),
    )
    tree_recycle_width: int = field(
        default=4,
        metadata=scope(
            ("--tree-recycle-width",), ("sd",), RECYCLE_DRAFTERS, why="the recycle source of a token tree"
        ),
    )
    tree_model_depth: int = field(
        default=4,
        metadata=scope(
            ("--tree-model-depth",), ("sd",), TREE_MODEL_DRAFTERS, why="the model source of a token tree"
        ),
    )
    tree_model_width: int = field(
        default=4,
        metadata=scope(
            ("--tree-model-width",), ("sd",), TREE_MODEL_DRAFTERS, why="the model source of a token tree"
        ),
    )

    def __post_init__(self) -> None:
        _choice("mode", self.mode, MODES, "--mode")
        _whole_up_to_gamma_max(
            self,
            "gamma",
            f"gamma must be a whole number from 1 to {GAMMA_MAX} (got {self.gamma!r}); "
            "it is the number of drafted tokens per round",
            f"gamma must be from 1 to {GAMMA_MAX} (got {self.gamma}); "
            "it is the number of drafted tokens per round, set --gamma in that range",
        )
        _choice("drafter", self.drafter, DRAFTERS, "--drafter")
        for name, flags in (
            ("skip", "--skip-attn/--skip-mlp"),
            ("draft_skip", "--draft-skip-attn/--draft-skip-mlp"),
        ):
            if not isinstance(getattr(self, name), SkipSet):
                raise UserError(
                    f"{name} must be a SkipSet (got {type(getattr(self, name)).__name__}); "
                    f"build it with SkipSet.of(attn, mlp) or pass {flags}"
                )
        for name in ("tau_accept", "tau_escalate"):
            value = _real(name, getattr(self, name))
            if not (math.isfinite(value) and value >= 0):
                flag = "--" + name.replace("_", "-")
                raise UserError(
                    f"thresholds must be >= 0 and finite: {name} ({flag}) is {value}; "
                    "set it to a number such as 0.5"
                )
            object.__setattr__(self, name, value)
        if self.tau_accept > self.tau_escalate:
            raise UserError(
                f"tau_accept ({self.tau_accept}) is above tau_escalate ({self.tau_escalate}); "
                "tau_accept must be <= tau_escalate: lower --tau-accept or raise --tau-escalate"
            )
        _choice("kl", self.kl, KL_KINDS, "--kl")
        if not isinstance(self.recheck, bool):
            raise UserError(f"recheck must be true or false (got {self.recheck!r})")
        confidence = _real("draft_confidence", self.draft_confidence)
        if not (math.isfinite(confidence) and 0 <= confidence < 1):
            raise UserError(
                f"draft_confidence (--draft-confidence) must be in [0, 1) (got {confidence}); 0 turns it off, "
                "e.g. 0.4 stops drafting once the drafter's top-1 probability is below 0.4"
            )
        object.__setattr__(self, "draft_confidence", confidence)
        _whole_up_to_gamma_max(
            self,
            "lookup_min",
            f"lookup_min (--lookup-min) must be a whole number from 1 to {GAMMA_MAX} (got {self.lookup_min!r}); "
            "it is the shortest prompt-lookup proposal a hybrid drafter uses",
            f"lookup_min (--lookup-min) must be from 1 to {GAMMA_MAX} (got {self.lookup_min}); shorter "
            "prompt-lookup proposals let the model drafter draft instead, e.g. 2",
        )
        self._check_tree()
        check_applicable(self.mode, self.drafter, self.set_fields())

    def _check_tree(self) -> None:
        """The tree fields, and the combinations the engine does not run (refused before any model loads)."""
        n = self.tree_nodes
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or not 0 <= n <= TREE_NODES_MAX:
            raise UserError(
                f"tree_nodes (--tree-nodes) must be a whole number from 0 to {TREE_NODES_MAX} (got {n!r}); "
                "it is the token tree's node budget, 0 or 1 a chain"
            )
        object.__setattr__(self, "tree_nodes", int(n))
        _choice("tree_sizing", self.tree_sizing, TREE_SIZINGS, "--tree-sizing")
        for name in TREE_SOURCE_FIELDS:
            flag = "--" + name.replace("_", "-")
            _whole_up_to_gamma_max(
                self,
                name,
                f"{name} ({flag}) must be a whole number from 1 to {GAMMA_MAX} (got {getattr(self, name)!r})",
                f"{name} ({flag}) must be from 1 to {GAMMA_MAX} (got {getattr(self, name)})",
            )
        if self.mode == "ar":
            return
        if self.tree_sizing != "fixed" and self.tree_nodes <= 1:
            raise UserError(
                f"tree_sizing (--tree-sizing) {self.tree_sizing} cuts a token tree each round, and this is a chain "
                f"(tree_nodes {self.tree_nodes}); set --tree-nodes above 1 or drop --tree-sizing"
            )
        shaped = [f for f in TREE_SOURCE_FIELDS if f in self.set_fields()]
        if shaped and not self.is_tree:
            raise UserError(
                f"{', '.join(label(f) for f in shaped)} shape a token tree, and this is a chain; "
                "set --tree-nodes above 1 (or a recycling drafter), or drop them"
            )
        if not self.is_tree:
            return
        if self.mode == "viasd":
            raise UserError(
                "mode viasd verifies chains only (the slim verifier does not score token trees or recycled drafts); "
                "use --mode sd with --tree-nodes, or --tree-nodes 1 and a chain drafter for VIA-SD"
            )
        if self.model_drafter == "self":
            raise UserError(
                f"drafter '{self.drafter}' does not build token trees (the self-draft shares the target's cache); "
                "use --tree-nodes 1, or a tree drafter: lookup, recycle, lookup+recycle, model, lookup+model, "
                "lookup+recycle+model"
            )

    @property
    def is_tree(self) -> bool:
        """Whether rounds run over a token tree (``tree_nodes`` > 1, or a recycling drafter, even as a chain)."""
        return self.tree_nodes > 1 or self.drafter in RECYCLE_DRAFTERS

    def set_fields(self) -> list[str]:
        """The fields whose value is not their default (nor another value that means unset)."""
        out = []
        for f in fields(self):
            default = f.default_factory() if f.default_factory is not MISSING else f.default
            value = getattr(self, f.name)
            if value != default and value not in field_scope(f)["idle"]:
                out.append(f.name)
        return out

    @property
    def model_drafter(self) -> str | None:
        """``model``/``self``: the model-based drafter this configuration runs (alone or behind lookup)."""
        return model_drafter(self.drafter)

    # ------------------------------------------------------------------------------------------- models

    def validate(self, n_layers: int, draft_layers: int | None = None) -> DecodeConfig:
        """The checks that need the models: ``n_layers`` is the target's layer count (the slim verifier's and the
        self-draft's skip sets index it; 0 when neither is used), ``draft_layers`` the separate draft model's
        (``None``: there is no draft model; 0 when its skip set is empty). Returns ``self``."""
        if isinstance(draft_layers, bool):
            raise TypeError(
                "draft_layers is the draft model's layer count (None: no draft model), not a bool"
            )
        if self.mode == "ar":
            return self
        if self.model_drafter == "model":
            if draft_layers is None:
                raise UserError(
                    f"drafter '{self.drafter}' needs a draft model; pass --draft, or use --draft-skip (self) or lookup"
                )
            if not self.draft_skip.is_empty:
                self.draft_skip.validate(draft_layers)
        if self.model_drafter == "self":
            if self.draft_skip.is_empty:
                raise UserError(
                    f"the self-draft needs a skip set (drafter '{self.drafter}'); "
                    "pass --draft-skip-attn/--draft-skip-mlp"
                )
            self.draft_skip.validate(n_layers)
        if self.mode == "viasd":
            self.skip.validate(n_layers)
        return self

    # ------------------------------------------------------------------------------------------- profile

    def to_profile(self) -> dict[str, Any]:
        """The decoding fields of a profile (``mode``, ``gamma``, ``drafter``, ``routing``, ``thresholds``,
        ``recheck``, ``draft_confidence``, ``lookup_min``, ``tree`` and ``draft.kind``/skip set); the exporter adds
        models and metrics.
        ``draft.name``/``fingerprint`` are the draft model's and are not part of the configuration."""
        draft: dict[str, Any] = {"kind": self.drafter}
        if self.model_drafter == "self" or (self.model_drafter == "model" and not self.draft_skip.is_empty):
            draft.update(self.draft_skip.to_dict())
        return {
            "mode": self.mode,
            "draft": draft,
            "routing": self.skip.to_dict(),
            "thresholds": {"tau_accept": self.tau_accept, "tau_escalate": self.tau_escalate, "kl": self.kl},
            "gamma": self.gamma,
            "drafter": self.drafter,
            "recheck": self.recheck,
            "draft_confidence": self.draft_confidence,
            "lookup_min": self.lookup_min,
            "tree": {
                "nodes": self.tree_nodes,
                "sizing": self.tree_sizing,
                **{
                    source: {
                        "depth": getattr(self, f"tree_{source}_depth"),
                        "width": getattr(self, f"tree_{source}_width"),
                    }
                    for source in TREE_SOURCES
                },
            },
        }

    @classmethod
    def from_profile(cls, profile: dict[str, Any]) -> DecodeConfig:
        """The configuration a (schema-valid) profile pins. A profile without ``mode`` (written before it
        existed) is VIA-SD; without ``recheck``/``draft_confidence``, they are off; without ``lookup_min``, 1;
        without ``tree`` (or any of its fields), a chain and the defaults (``sizing`` fixed)."""
        draft, thresholds, routing = profile["draft"], profile["thresholds"], profile["routing"]
        tree = profile.get("tree", {})
        sources = {
            f"tree_{source}_{what}": tree[source][what]
            for source in TREE_SOURCES
            for what in ("depth", "width")
            if what in tree.get(source, {})
        }
        return cls(
            mode=profile.get("mode", "viasd"),
            gamma=profile["gamma"],
            drafter=profile["drafter"],
            skip=SkipSet.of(routing["skip_attn"], routing["skip_mlp"]),
            draft_skip=SkipSet.of(draft.get("skip_attn", []), draft.get("skip_mlp", [])),
            tau_accept=thresholds["tau_accept"],
            tau_escalate=thresholds["tau_escalate"],
            kl=thresholds["kl"],
            recheck=profile.get("recheck", False),
            draft_confidence=profile.get("draft_confidence", 0.0),
            lookup_min=profile.get("lookup_min", 1),
            tree_nodes=tree.get("nodes", 1),
            tree_sizing=tree.get("sizing", "fixed"),
            **sources,
        )

    # ------------------------------------------------------------------------------------------- record

    def to_dict(self) -> dict[str, Any]:
        """Flat and JSON-able: a trial's user attr ``config`` (what the dashboard and ``export`` read) and
        ``generate --json``'s ``config``. Skip sets become sorted ``skip_attn``/``skip_mlp`` and
        ``draft_skip_attn``/``draft_skip_mlp`` lists."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, SkipSet):
                prefix = "" if f.name == "skip" else "draft_"
                out[f"{prefix}skip_attn"], out[f"{prefix}skip_mlp"] = sorted(value.attn), sorted(value.mlp)
            else:
                out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> DecodeConfig:
        """Inverse of :meth:`to_dict`; a missing key takes its default (a trial recorded before the key
        existed, e.g. without ``mode``, was VIA-SD). A record is this package's own output, not user input: a value
        where it does nothing (older searches stored e.g. the first ``kl`` of the space on plain-SD trials) is
        dropped, not refused."""
        kwargs = {
            f.name: record[f.name]
            for f in fields(cls)
            if f.name not in ("skip", "draft_skip") and f.name in record
        }
        kwargs["skip"] = SkipSet.of(record.get("skip_attn", ()), record.get("skip_mlp", ()))
        kwargs["draft_skip"] = SkipSet.of(record.get("draft_skip_attn", ()), record.get("draft_skip_mlp", ()))
        mode, drafter = kwargs.get("mode", "viasd"), kwargs.get("drafter", "model")
        if isinstance(mode, str) and isinstance(drafter, str) and mode in MODES and drafter in DRAFTERS:
            kwargs = {
                k: v for k, v in kwargs.items() if k in ("mode", "drafter") or applies(k, mode, drafter)
            }
        return cls(**kwargs)


def _choice(name: str, value: Any, choices: tuple[str, ...], flag: str) -> None:
    if not isinstance(value, str) or value not in choices:
        raise UserError(f"unknown {name} {value!r}; use one of {_names(choices)} ({flag})")


def _real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise UserError(f"{name} must be a number (got {value!r}); pass e.g. 0.5")
    return float(value)


MAX_NEW_TOKENS_MAX = 1_000_000  # far beyond any context window; a bound so a typo cannot ask for 10**18


def check_generation(max_new_tokens: Any, temperature: Any = 0.0, top_p: Any = 1.0, seed: Any = None) -> None:
    """The per-request settings of ``generate`` (flags and :meth:`Decoder.generate` alike): checked before any
    model loads, with the same one-line :class:`UserError`."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
        raise UserError(
            f"max_new_tokens (--max-new-tokens) must be a whole number >= 1 (got {max_new_tokens!r})"
        )
    if not 1 <= max_new_tokens <= MAX_NEW_TOKENS_MAX:
        raise UserError(
            f"max_new_tokens (--max-new-tokens) must be from 1 to {MAX_NEW_TOKENS_MAX} (got {max_new_tokens})"
        )
    t = _real("temperature", temperature)
    if not (math.isfinite(t) and t >= 0):
        raise UserError(
            f"temperature (--temperature) must be a finite number >= 0 (got {t}); 0 is greedy, 0.7 samples"
        )
    p = _real("top_p", top_p)
    if not (math.isfinite(p) and 0 < p <= 1):
        raise UserError(f"top_p (--top-p) must be in (0, 1] (got {p}); 1 keeps the whole distribution")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
        raise UserError(f"seed (--seed) must be a whole number (got {seed!r})")
    if seed is not None and not 0 <= seed < 2**63:
        raise UserError(f"seed (--seed) must be from 0 to 2**63 - 1 (got {seed})")
    if t == 0 and (p != 1 or seed is not None):  # greedy: the top token, nothing drawn
        what = "top_p (--top-p)" if p != 1 else "seed (--seed)"
        raise UserError(
            f"{what} does nothing at temperature 0: greedy decoding takes the top token and draws nothing; "
            "drop it or set --temperature above 0 to sample"
        )
