"""One loaded model serves concurrent decoders with different skip sets (a routed profile served from threads):
the skip set of a forward is passed with it, never stored on the module, so two threads decoding at once give
the tokens each gives alone."""

from __future__ import annotations

import random
import threading

from conftest import VOCAB, tiny_model

from viasd_tune.config import DecodeConfig
from viasd_tune.decoding.decoder import Decoder
from viasd_tune.routing import SkipSet

# Lossy VIA-SD (no recheck) with self-drafts: the tokens depend on both skip sets, so a forward that ran under
# the other thread's skip set shows in the output.
CONFIGS = (
    DecodeConfig(
        gamma=4,
        drafter="self",
        draft_skip=SkipSet.of([1, 2], [1, 2]),
        skip=SkipSet.of([1], []),
        tau_accept=0.5,
        tau_escalate=50.0,
    ),
    DecodeConfig(
        gamma=3,
        drafter="self",
        draft_skip=SkipSet.of([2, 3], [0]),
        skip=SkipSet.of([], [1, 3]),
        tau_accept=0.5,
        tau_escalate=50.0,
    ),
)
NEW = 24
ROUNDS = 4


def test_two_threads_with_different_skip_sets_decode_as_they_do_alone(one_thread) -> None:
    model = tiny_model("llama", seed=3, layers=4, hidden=64)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 12))] for _ in range(6)]
    decoders = [Decoder(model, None, cfg, eos=set()) for cfg in CONFIGS]
    alone = [[d.generate(p, NEW).token_ids for p in prompts] for d in decoders]
    # Otherwise a forward run under the wrong skip set might not change a token, and the test could not fail.
    assert all(a != b for a, b in zip(*alone, strict=True))

    got: list[list[list[int]]] = [[], []]
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def work(k: int) -> None:
        try:
            start.wait()
            for _ in range(ROUNDS):
                got[k].extend(decoders[k].generate(p, NEW).token_ids for p in prompts)
        except BaseException as e:  # surfaced below: an exception in a thread would otherwise pass silently
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k in range(2):
        assert got[k] == alone[k] * ROUNDS, f"decoder {k}"
