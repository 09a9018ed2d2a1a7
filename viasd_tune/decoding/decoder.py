"""One object that holds the models and a decoding configuration and serves ``generate()`` (and ``stream()``):
what the CLI, the search, the runtime and the server all call."""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable

import torch
from torch import nn

from ..config import DRAFTERS, KL_KINDS, MODES, DecodeConfig, check_generation
from ..errors import UserError
from ..models import context_length
from ..routing import install_skipping, num_layers
from . import ar, sd, tree_sd, viasd
from .common import LM, CachedLM, Result, RoundHook, Sampling, Sequence, Stats
from .drafters import Drafter, HybridDrafter, LookupDrafter, ModelDrafter
from .streaming import StreamEnd, TextStream, check_stop
from .tree import check_attention
from .tree_drafters import CombinedDrafter, LookupSource, ModelSource, RecycleSource, RecycleTable
from .tree_sizing import Calibration, VerifyCost, measure_verify_cost

__all__ = [
    "DRAFTERS",
    "KL_KINDS",
    "MODES",
    "DecodeConfig",
    "Decoder",
    "StreamEnd",
    "TextStream",
]  # the config lives in viasd_tune.config


def _layer_counts(config: DecodeConfig, target: nn.Module, draft: nn.Module | None) -> tuple[int, int | None]:
    """What :meth:`DecodeConfig.validate` checks the skip sets against. A layer count is only read where a skip
    set applies to that model (reading it refuses architectures that cannot skip); 0 elsewhere."""
    skips_target = config.mode == "viasd" or (config.mode == "sd" and config.model_drafter == "self")
    skips_draft = config.mode != "ar" and config.model_drafter == "model" and not config.draft_skip.is_empty
    return (
        num_layers(target) if skips_target else 0,
        None if draft is None else num_layers(draft) if skips_draft else 0,
    )


class Decoder:
    """Target (+ optional draft model) and a :class:`DecodeConfig`; ``generate`` runs one request, ``stream``
    runs one as it happens.

    ``lm`` builds the engine's view of each model over its KV cache, called as ``CachedLM`` is (model, skip,
    tier, stats, sync): the models run for real by default; the search's replay serves recorded forwards.
    ``verify_cost``: the target's forward cost by block size, for ``tree_sizing`` ``cost`` (None: measured on
    this host when the decoder is built, before any request is timed; the search passes its cost model's curve)."""

    def __init__(
        self,
        target: nn.Module,
        tokenizer,
        config: DecodeConfig,
        draft: nn.Module | None = None,
        eos: set[int] | None = None,
        lm: Callable[..., LM] = CachedLM,
        verify_cost: VerifyCost | None = None,
    ):
        from ..models import eos_ids

        self.target, self.tokenizer, self.draft, self.lm = target, tokenizer, draft, lm
        self.config = config.validate(*_layer_counts(config, target, draft))
        if config.mode != "ar" and not (config.skip.is_empty and config.draft_skip.is_empty):
            install_skipping(target)
        if config.mode != "ar" and config.is_tree:
            for model in (target, draft if config.model_drafter == "model" else None):
                if model is not None:
                    check_attention(model)
        self.eos = eos if eos is not None else eos_ids(target, tokenizer)
        # Token recycling's tables, kept across requests as Token Recycling keeps its adjacency matrix (a hot
        # start): what the target predicted after each token in earlier requests drafts for the next ones. It only
        # changes what is proposed; the target verifies every node, so outputs stay lossless. One per width.
        self.recycled: dict[int, RecycleTable] = {}
        # What tree sizing learnt of the sources' acceptance, kept across requests as the tables are.
        self.calibration = Calibration()
        self.verify_cost = verify_cost
        if config.mode == "sd" and config.tree_sizing == "cost" and verify_cost is None:
            self.verify_cost = measure_verify_cost(target, config.tree_nodes + 1)  # before any request is timed

    def forget(self) -> None:
        """Start the next request cold: drop what token recycling and tree sizing learnt from earlier requests (a
        benchmark does this before each pass over its prompts, so a repeated prompt never drafts from its own earlier
        output)."""
        self.recycled.clear()
        self.calibration = Calibration()

    def encode(self, prompt, chat: str = "auto") -> torch.Tensor:
        """Prompt text, chat messages or token ids → 1-D id tensor on the target's device."""
        return torch.tensor(self.prompt_ids(prompt, chat), dtype=torch.long, device=self.target.device)

    def prompt_ids(self, prompt, chat: str = "auto") -> list[int]:
        """Prompt text, chat messages or token ids → checked token ids on the host."""
        if isinstance(prompt, torch.Tensor):
            ids = prompt.flatten().tolist()
        elif isinstance(prompt, str):
            from ..prompts import encode_prompt

            ids = encode_prompt(self.tokenizer, prompt, chat)
        elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            from ..prompts import encode_messages

            ids = encode_messages(self.tokenizer, list(prompt))
        elif (
            not isinstance(prompt, (bytes, dict))
            and hasattr(prompt, "__iter__")
            and all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt)
        ):  # token ids: a list, a tuple, a numpy array
            ids = [int(t) for t in prompt]
        else:
            raise UserError(
                "the prompt must be text, chat messages (a list of dicts) or token ids "
                f"(got {type(prompt).__name__})"
            )
        vocab = self.target.get_input_embeddings().num_embeddings
        if any(not 0 <= t < vocab for t in ids):
            raise UserError(f"the prompt's token ids must be in 0..{vocab - 1} (the model's vocabulary)")
        if not ids:
            raise UserError("the prompt is empty; give at least one token of text")
        return ids

    def _drafter(self, full: LM, sampling: Sampling, gen, stats: Stats, sync: bool) -> Drafter:
        cfg = self.config
        if cfg.model_drafter is None:
            return LookupDrafter(stats)
        if cfg.model_drafter == "self":
            model = ModelDrafter(
                full, sampling, gen, stats, skip=cfg.draft_skip, confidence=cfg.draft_confidence
            )
        else:
            lm = self.lm(self.draft, cfg.draft_skip, tier="draft", stats=stats, sync=sync)
            model = ModelDrafter(lm, sampling, gen, stats, confidence=cfg.draft_confidence)
        if cfg.drafter == cfg.model_drafter:
            return model
        return HybridDrafter(LookupDrafter(stats), model, cfg.lookup_min)

    def _tree_drafter(
        self, sampling: Sampling, gen, stats: Stats, sync: bool, warm: bool = True
    ) -> CombinedDrafter:
        """The drafter's sources (lookup, recycling, the draft model), merged under the node budget; as a chain
        (``tree_nodes`` ≤ 1) each source proposes its top path and the first one deep enough is the round's.
        ``warm``: token recycling drafts from (and adds to) the table kept across requests; else from a fresh one."""
        cfg = self.config
        chain = cfg.tree_nodes <= 1
        parts = cfg.drafter.split("+")
        sources: list = []
        if "lookup" in parts:
            sources.append(LookupSource(cfg.tree_lookup_depth, 1 if chain else cfg.tree_lookup_width))
        if "recycle" in parts:
            vocab = self.target.get_output_embeddings().weight.shape[0]
            width = 1 if chain else cfg.tree_recycle_width
            table = self.recycled.get(width) if warm else None
            if table is None:
                table = RecycleTable(vocab, width)
                if warm:
                    self.recycled[width] = table
            sources.append(RecycleSource(vocab, cfg.tree_recycle_depth, width, table))
        if "model" in parts:
            lm = self.lm(self.draft, cfg.draft_skip, tier="draft", stats=stats, sync=sync)
            width = 1 if chain else cfg.tree_model_width
            sources.append(ModelSource(lm, cfg.tree_model_depth, width, sampling, gen, cfg.draft_confidence))
        budget = cfg.gamma if chain else cfg.tree_nodes
        sizing = None
        if cfg.tree_sizing == "cost":
            sizing = (self.calibration if warm else Calibration(), self.verify_cost)
        return CombinedDrafter(sources, budget, stats, cfg.lookup_min, chain=chain, sizing=sizing)

    @torch.inference_mode()
    def generate(
        self,
        prompt,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        chat: str = "auto",
        tier_timing: bool = False,
    ) -> Result:
        """Decode one request. ``prompt``: text, chat messages, or token ids. Returns ids, text and stats.

        Per-tier times (``*_time_s``) are exact on the CPU; on CUDA they need a synchronize after every forward,
        which costs speed, so they are only measured with ``tier_timing``."""
        ids = self._checked_ids(prompt, max_new_tokens, temperature, top_p, seed, chat)
        result = self._decode(ids, max_new_tokens, temperature, top_p, seed, tier_timing)
        if self.tokenizer is not None:
            result.text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        return result

    def stream(
        self,
        prompt,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        chat: str = "auto",
        stop: str | list[str] | None = None,
    ) -> TextStream:
        """:meth:`generate` as it happens: an iterator of text pieces, decoded as rounds commit final tokens
        (never a broken multi-byte character), then one :class:`StreamEnd` with the result and its stats. Decoding
        ends at EOS, ``max_new_tokens`` or a ``stop`` string (cut from the text). Bad input raises here, before
        decoding starts in its own thread; the stream's ``cancel()`` / ``close()`` stop it within a round."""
        if self.tokenizer is None:
            raise UserError("streaming decodes text, so the decoder needs a tokenizer")
        stops = check_stop(stop)
        ids = self._checked_ids(prompt, max_new_tokens, temperature, top_p, seed, chat)

        def run(hook: RoundHook) -> Result:
            return self._decode(ids, max_new_tokens, temperature, top_p, seed, False, on_round=hook)

        return TextStream(run, self.tokenizer, self.eos, stops)

    def _checked_ids(self, prompt, max_new_tokens, temperature, top_p, seed, chat) -> torch.Tensor:
        check_generation(max_new_tokens, temperature, top_p, seed)
        ids = self.encode(prompt, chat)
        ctx = context_length(self.target)
        if len(ids) + max_new_tokens > ctx:  # positions past it give garbage, not an error
            raise UserError(
                f"the prompt has {len(ids)} tokens; with max_new_tokens {max_new_tokens} that exceeds the "
                f"model's context length {ctx}; shorten the prompt or lower --max-new-tokens"
            )
        return ids

    @torch.inference_mode()  # also where stream() runs it, in its own thread
    def _decode(
        self,
        ids: torch.Tensor,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None,
        tier_timing: bool,
        on_round: RoundHook | None = None,
    ) -> Result:
        sampling = Sampling(temperature, top_p)
        gen = None
        if not sampling.greedy:
            gen = torch.Generator(device=ids.device)
            gen.manual_seed(seed if seed is not None else torch.seed())
        cfg = self.config
        start = time.perf_counter()
        stats = Stats()
        sync = tier_timing and ids.device.type == "cuda"
        full = self.lm(self.target, tier="full", stats=stats, sync=sync)
        seq = Sequence(ids, capacity=len(ids) + max_new_tokens + cfg.gamma + 1)
        if cfg.mode == "ar":
            result = ar.generate(full, seq, max_new_tokens, self.eos, sampling, gen, on_round)
        elif cfg.is_tree:
            # A seeded sample must repeat whatever ran before it, so it drafts from a cold table; a greedy output
            # is the target's whatever the drafts, and an unseeded sample is random anyway.
            warm = sampling.greedy or seed is None
            drafter = self._tree_drafter(sampling, gen, stats, sync, warm)
            result = tree_sd.generate(
                full, drafter, seq, max_new_tokens, self.eos, cfg.gamma, sampling, gen, on_round
            )
        else:
            drafter = self._drafter(full, sampling, gen, stats, sync)
            if (cfg.mode == "viasd" or cfg.model_drafter == "self") and len(ids) > 1:
                # Other passes share the target's cache: the target reads the prompt once, before them.
                full.forward(seq.ids[:-1], keep=1, tier="prefill")
            if cfg.mode == "sd":
                result = sd.generate(
                    full, drafter, seq, max_new_tokens, self.eos, cfg.gamma, sampling, gen, on_round
                )
            else:
                result = viasd.generate(
                    full, drafter, seq, max_new_tokens, self.eos, cfg, sampling, gen, on_round
                )
        if ids.device.type == "cuda":
            torch.cuda.synchronize()
        stats.wall_time_s = time.perf_counter() - start  # prefill included, as in every baseline we compare with
        return result
