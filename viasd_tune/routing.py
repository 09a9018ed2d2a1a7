"""Intra-model routing: run the target with a subset of its attention / MLP sub-layers skipped.

The slim verifier (and the self-draft) is the *same* module as the full target: weights are shared, never
copied. Each decoder layer's ``self_attn`` and ``mlp`` get a thin wrapper, installed once, that reads the skip
set of the forward running in the caller's context (:func:`skipping`, a :class:`contextvars.ContextVar`): the
model holds no skip state, so one loaded model serves concurrent decoders (threads, asyncio tasks) with
different skip sets. A forward kwarg cannot carry it: transformers 5 (llama, qwen2, gemma3) passes a decoder
layer's kwargs to ``self_attn`` but calls ``self.mlp(hidden_states)`` without them. A skipped sub-layer
returns zeros, so the residual stream passes through unchanged (``h + 0``); for Gemma-3 the post-norm of zeros
is zero too. A skipped attention never touches the KV cache, so the full target, the slim verifier and the
self-draft share one :class:`SharedKVCache`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import re
import threading
import types
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache

from .errors import UserError

# model_type values whose decoder layers we know to be ``h + attn(norm(h))`` then ``h + mlp(norm(h))``
# (Gemma-3 adds post-norms, which map zeros to zeros).
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "gemma3_text", "gemma3")


@dataclass(frozen=True)
class SkipSet:
    """Which decoder layers' attention and MLP sub-layers to skip (0-based layer indices)."""

    attn: frozenset[int] = frozenset()
    mlp: frozenset[int] = frozenset()

    @classmethod
    def of(cls, attn: Iterable[int] = (), mlp: Iterable[int] = ()) -> SkipSet:
        return cls(frozenset(int(i) for i in attn), frozenset(int(i) for i in mlp))

    @classmethod
    def parse(
        cls, attn: str | None, mlp: str | None, flags: tuple[str, str] = ("--skip-attn", "--skip-mlp")
    ) -> SkipSet:
        """Parse CLI lists such as ``"3,5,7"`` or ranges ``"3-7"``; ``flags`` name them in error messages."""
        return cls.of(_parse_indices(attn, flags[0]), _parse_indices(mlp, flags[1]))

    def __or__(self, other: SkipSet) -> SkipSet:
        return SkipSet(self.attn | other.attn, self.mlp | other.mlp)

    @property
    def is_empty(self) -> bool:
        return not self.attn and not self.mlp

    def validate(self, num_layers: int) -> SkipSet:
        """Refuse indices outside the model and a skip set that removes every sub-layer."""
        for kind, idx in (("attention", self.attn), ("MLP", self.mlp)):
            bad = sorted(i for i in idx if not 0 <= i < num_layers)
            if bad:
                raise UserError(
                    f"{kind} skip index {bad[0]} is out of range: the model has {num_layers} layers (0..{num_layers - 1})"
                )
        if len(self.attn) == num_layers and len(self.mlp) == num_layers:
            raise UserError(
                "the skip set removes every sub-layer; keep at least one attention or MLP sub-layer"
            )
        return self

    def fraction(self, num_layers: int) -> float:
        """Share of the model's 2·L sub-layers that are skipped."""
        return (len(self.attn) + len(self.mlp)) / (2 * num_layers)

    def to_dict(self) -> dict[str, list[int]]:
        return {"skip_attn": sorted(self.attn), "skip_mlp": sorted(self.mlp)}


MAX_LAYER_INDEX = 9_999  # no model has this many layers; checked before a range is expanded


def _parse_indices(text: str | None, flag: str) -> list[int]:
    """``3,5,7`` or ``3-7`` (inclusive) → indices; a range is checked before it is expanded, so a typo such as
    ``0-1000000000`` is a one-line error, not gigabytes of list."""
    if not text:
        return []
    out: list[int] = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        try:
            if "-" in part[1:]:
                lo, hi = (int(x) for x in part.split("-", 1))
            else:
                lo = hi = int(part)
        except ValueError:
            raise UserError(
                f"{flag} {text!r} is not a list of layer indices; write e.g. 3,5,7 or 3-7"
            ) from None
        if lo > hi:
            raise UserError(f"{flag}: the range {lo}-{hi} is reversed; write it low to high, e.g. {hi}-{lo}")
        if lo < 0 or hi > MAX_LAYER_INDEX:
            bad = lo if lo < 0 else hi
            raise UserError(
                f"{flag}: layer index {bad} is out of range; indices are 0 or more (and below the model's "
                "layer count)"
            )
        out.extend(range(lo, hi + 1))
    return out


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer list of a supported causal LM, or a clear error for other architectures."""
    model_type = getattr(model.config, "model_type", "?")
    layers = getattr(getattr(model, "model", None), "layers", None)
    if model_type not in SUPPORTED_MODEL_TYPES or layers is None:
        raise UserError(
            f"layer skipping does not support model type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return layers


def num_layers(model: nn.Module) -> int:
    return len(decoder_layers(model))


# The sub-layers (module ids) skipped by the forward running in this context; None: every sub-layer runs.
_ACTIVE: contextvars.ContextVar[frozenset[int] | None] = contextvars.ContextVar("viasd_skip", default=None)
_INSTALL = threading.Lock()


def _skippable_forward(self: nn.Module, hidden_states: torch.Tensor, *args, **kwargs):
    """A sub-layer's forward: zeros while the forward running in the caller's context skips it."""
    active = _ACTIVE.get()
    if active is not None and id(self) in active:
        zeros = torch.zeros_like(hidden_states)
        return (zeros, None) if self._viasd_kind == "attn" else zeros
    return self._viasd_inner(hidden_states, *args, **kwargs)


def install_skipping(model: nn.Module) -> None:
    """Make every attention and MLP sub-layer skippable (idempotent and thread-safe; weights untouched). The
    wrappers are methods bound to their sub-layer, so a deep copy of the model gets its own."""
    with _INSTALL:
        if getattr(model, "_viasd_skippable", False):
            return
        for layer in decoder_layers(model):
            for kind, module in (("attn", layer.self_attn), ("mlp", layer.mlp)):
                module._viasd_kind, module._viasd_inner = kind, module.forward
                module.forward = types.MethodType(_skippable_forward, module)
        model._viasd_skippable = True  # the wrappers are installed; the skip set itself is never stored here


@contextlib.contextmanager
def skipping(model: nn.Module, skip: SkipSet | None) -> Iterator[None]:
    """Run the forwards of ``model`` inside the block under ``skip`` (``None`` or empty: the full model). The skip
    set lives in the caller's context only: another thread or task running the same model is unaffected."""
    active = None
    if skip is not None and not skip.is_empty:
        install_skipping(model)
        layers = decoder_layers(model)
        attn = {id(layers[i].self_attn) for i in skip.attn}
        active = frozenset(attn | {id(layers[i].mlp) for i in skip.mlp})
    token = _ACTIVE.set(active)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


# The oldest transformers whose models decode through SharedKVCache exactly (5.17-5.23 gave plain SD tokens that
# differ from greedy decoding, and slim passes of the wrong length; benchmarks/cuda_check.py found it on a GPU
# machine's transformers 5.17). pyproject.toml's floor says the same.
MIN_TRANSFORMERS = (5, 24)


@functools.cache
def check_transformers(version: str | None = None) -> None:
    """Refuse, in one line, a transformers release the shared cache is known to decode wrongly with."""
    import transformers

    version = version or transformers.__version__
    got = tuple(int(x) for x in re.findall(r"\d+", version)[:2])
    if got < MIN_TRANSFORMERS:
        need = ".".join(map(str, MIN_TRANSFORMERS))
        raise UserError(
            f"transformers {version} is too old for viasd-tune's shared KV cache (needs >= {need}: older "
            f"releases decode wrong tokens); run pip install -U 'transformers>={need},<6'"
        )


class KVExtents:
    """The rules of a KV cache shared by a model's full pass and its skip passes, on lengths alone: how far each
    layer's entries reach, where a pass starts feeding and what a discard or rollback keeps.

    ``committed``: every layer the full pass runs holds entries that a full pass wrote for positions
    ``[0, committed)``. A pass that skips sub-layers reads those, writes speculative entries beyond them in the
    layers whose attention it runs, and nothing elsewhere, so layers can differ in length. The full pass always
    starts at ``committed``: it never attends to a speculative entry. :class:`SharedKVCache` keeps its tensors to
    these lengths; the search's replay, which serves recorded forwards, uses them alone.
    """

    def __init__(self, n_layers: int, base: SkipSet | None = None):
        self.base = (
            base or SkipSet()
        )  # what "full" means for this cache: a draft model may run with a skip set
        self.lengths = [0] * n_layers
        self.committed = 0

    def running(self, skip: SkipSet | None) -> list[int]:
        """Layers whose attention runs (and so reads and writes this cache) under ``skip`` (None: full)."""
        skipped = self.base.attn | (skip.attn if skip is not None else frozenset())
        return [i for i in range(len(self.lengths)) if i not in skipped]

    def begin(self, skip: SkipSet | None, end: int) -> int:
        """A pass under ``skip`` (None: the full pass) feeds the sequence up to ``end``: return the position it
        starts feeding at, and record what it writes. The full pass starts at ``committed`` and commits ``end``;
        a skip pass where its running layers agree, which is at least ``committed`` (its own speculative entries
        beyond it stay valid until a rollback or another pass crops them)."""
        running = self.running(skip)
        start = (
            self.committed
            if skip is None
            else min((self.lengths[i] for i in running), default=self.committed)
        )
        assert end > start, "nothing new to feed"
        for i in running:
            self.lengths[i] = end
        if skip is None:
            self.committed = end
        return start

    def begin_tree(self, end: int, nodes: int, fed: int = 0) -> int:
        """A full pass feeds the sequence up to ``end`` and, behind it, token-tree nodes ``fed … nodes - 1``
        (nodes ``[0, fed)`` are cached there already, from a drafter's earlier level, when nothing is pending):
        return the cache position it starts writing at. It commits ``end``; the nodes' entries stay beyond
        ``committed`` until :meth:`keep_path` or a rollback drops them."""
        if end > self.committed:
            assert fed == 0, "tree nodes are cached behind an uncommitted sequence"
            start = self.committed
        else:
            start = end + fed
        assert end + nodes > start, "nothing new to feed"
        for i in self.running(None):
            self.lengths[i] = end + nodes
        self.committed = end
        return start

    def keep_path(self, tail: int, path: Sequence[int]) -> None:
        """After a tree pass: of the ``tail`` node entries behind ``committed``, the ``path``'s become the next
        committed ones and the rest are dropped."""
        for i in self.running(None):
            self.lengths[i] = min(self.lengths[i], self.committed + len(path))
        self.committed += len(path)

    def discard(self, skip: SkipSet) -> None:
        """Drop the speculative entries of the layers ``skip`` runs (a self-draft cleans up after drafting)."""
        for i in self.running(skip):
            self.lengths[i] = min(self.lengths[i], self.committed)

    def rollback(self, length: int, floor: int | None = None) -> None:
        """Forget every entry at positions >= ``length`` (``floor`` only matters to a cache that holds tensors)."""
        self.lengths = [min(n, length) for n in self.lengths]
        self.committed = min(self.committed, length)


class SharedKVCache(DynamicCache):
    """One model's KV cache, shared by its full passes and by passes that skip sub-layers (slim verifier,
    self-draft), as Self-SD, SWIFT and LayerSkip do. Which entries a pass reads and writes is
    :class:`KVExtents`' rule; this class keeps its tensors to it: :meth:`begin` crops the layers a pass runs to one
    start and points transformers' mask and length lookups at a layer that runs.
    """

    def __init__(self, config, base: SkipSet | None = None):
        check_transformers()
        super().__init__(config=config)
        # Sliding-window layers must keep their past until we trim it, or a rejected draft could not be rolled
        # back; :meth:`rollback` trims them to what a later crop can still need.
        self.activate_past_recording()
        self.extents = KVExtents(len(self.layers), base)
        self._ref = list(range(len(self.layers)))
        self._refs: dict[SkipSet | None, list[int]] = {}

    @property
    def base(self) -> SkipSet:
        return self.extents.base

    @property
    def committed(self) -> int:
        return self.extents.committed

    def running(self, skip: SkipSet | None) -> list[int]:
        return self.extents.running(skip)

    def length(self, layer_idx: int) -> int:
        return self.layers[layer_idx].get_seq_length()

    def begin(self, skip: SkipSet | None, end: int) -> int:
        """Prepare a forward under ``skip`` (None: the full pass) of the sequence up to ``end`` and return the
        position it starts feeding at (:meth:`KVExtents.begin`)."""
        start = self.extents.begin(skip, end)
        running = self.running(skip)
        for i in running:
            self._crop_layer(i, start)
        self._ref = self._refs.get(skip) or self._refs.setdefault(skip, self._reference_layers(running))
        return start

    def begin_tree(self, end: int, nodes: int, fed: int = 0) -> int:
        """Prepare a full pass over a token tree below the sequence up to ``end`` (:meth:`KVExtents.begin_tree`)."""
        start = self.extents.begin_tree(end, nodes, fed)
        running = self.running(None)
        if not fed:
            for i in running:
                self._crop_layer(i, start)
        self._ref = self._refs.get(None) or self._refs.setdefault(None, self._reference_layers(running))
        return start

    def keep_path(self, tail: int, path: Sequence[int]) -> None:
        """After a tree pass, in every layer the full pass runs, whose last ``tail`` entries are tree nodes in
        node order: move the entries of ``path`` (root to node, ascending) right behind the committed ones (an
        index copy) and drop the rest (:meth:`KVExtents.keep_path`)."""
        m, drop = len(path), tail - len(path)
        moved = list(path) != list(range(m))
        for i in self.running(None):
            lay = self.layers[i]
            if not tail or not lay.is_initialized:
                continue
            length = lay.keys.shape[-2]
            if moved:
                idx = torch.tensor(path, device=lay.keys.device) + (length - tail)
                for name in ("keys", "values"):
                    t = getattr(lay, name)
                    t[..., length - tail : length - tail + m, :] = t.index_select(-2, idx)
            if drop:
                lay.keys, lay.values = lay.keys[..., : length - drop, :], lay.values[..., : length - drop, :]
                if lay.is_sliding:
                    lay.cumulative_length -= drop
        self.extents.keep_path(tail, path)

    def discard(self, skip: SkipSet) -> None:
        """Drop the speculative entries of the layers ``skip`` runs (a self-draft cleans up after drafting)."""
        self.extents.discard(skip)
        self._crop_to_extents()

    def rollback(self, length: int, floor: int | None = None) -> None:
        """Forget every entry at positions >= ``length``, then trim sliding layers to what a later crop can still
        need: no crop goes below ``floor`` (default: ``committed``; a draft model's cache passes the target's,
        since a re-check can roll back that far)."""
        self.extents.rollback(length)
        self._crop_to_extents()
        floor = self.committed if floor is None else min(floor, self.committed)
        for lay in self.layers:
            if lay.is_sliding and lay.is_initialized:
                # Positions below floor - (window - 1) are never attended again: keep the rest only.
                keep = lay.get_seq_length() - max(0, floor - (lay.sliding_window - 1))
                if lay.keys.shape[-2] > keep:
                    lay.keys, lay.values = lay.keys[..., -keep:, :], lay.values[..., -keep:, :]

    def entries(self) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Every layer's keys and values (None where nothing was written), none trimmed: what :meth:`adopt`
        starts another cache from."""
        out = []
        for lay in self.layers:
            if not lay.is_initialized:
                out.append(None)
                continue
            assert lay.keys.shape[-2] == lay.get_seq_length(), "a trimmed sliding layer cannot be adopted"
            out.append((lay.keys, lay.values))
        return out

    def adopt(self, entries: list[tuple[torch.Tensor, torch.Tensor] | None], length: int) -> None:
        """Start, empty, from the first ``length`` positions of full-pass ``entries`` (another cache's
        :meth:`entries` over the same base skip set): committed to ``length`` without a forward. The tensors are
        shared as views; every later write concatenates into new ones."""
        assert self.committed == 0 and length > 0
        for i, (lay, kv) in enumerate(zip(self.layers, entries, strict=True)):
            if kv is not None and i in self.running(None):
                lay.update(kv[0][..., :length, :], kv[1][..., :length, :])
        self.extents.begin(None, length)

    def _crop_to_extents(self) -> None:
        for i, length in enumerate(self.extents.lengths):
            self._crop_layer(i, length)

    def _crop_layer(self, i: int, length: int) -> None:
        lay = self.layers[i]
        drop = lay.get_seq_length() - length
        if drop <= 0 or not lay.is_initialized:
            return
        # Sliced by hand: transformers' sliding-layer crop also trims to the window, losing entries a later crop
        # back to ``committed`` still needs.
        lay.keys, lay.values = lay.keys[..., :-drop, :], lay.values[..., :-drop, :]
        if lay.is_sliding:
            lay.cumulative_length -= drop
            # A rollback below the floor the last trim kept would have lost entries the window still needs.
            assert lay.keys.shape[-2] >= min(length, lay.sliding_window - 1), "cropped below the trim floor"

    def _reference_layers(self, running: list[int]) -> list[int]:
        """transformers sizes masks from one layer of each kind (full / sliding): use one that runs."""
        ref = list(range(len(self.layers)))
        for sliding in (True, False):
            same = [i for i, lay in enumerate(self.layers) if lay.is_sliding == sliding]
            live = [i for i in same if i in running] or running[:1]
            for i in same:
                ref[i] = live[0] if live else i
        return ref

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return super().get_seq_length(self._ref[layer_idx] if layer_idx < len(self._ref) else layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return super().get_mask_sizes(
            query_length, self._ref[layer_idx] if layer_idx < len(self._ref) else layer_idx
        )
