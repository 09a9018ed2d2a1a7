"""``viasd-tune bench``: our decoders and tuned VIA-SD profiles against Hugging Face ``generate``, per task group.

Every method decodes the same prompts with the same models, dtype and device, greedy, interleaved: for every
(repeat, prompt) each method runs once and the method order rotates, so no method always runs first (a warm
cache or a noisy neighbour then hits all methods alike). One untimed warm-up per method comes first.

Methods (``hf`` always runs: it is the baseline every speedup is measured against):

==========================  ===================================================================================
``hf``                      ``target.generate(ids, do_sample=False)``
``ar``                      our autoregressive decoder
``hf-assisted``             HF assisted generation with the same draft, exactly γ drafts per round (the
                            algorithm ``sd`` runs); HF reads these knobs from ``assistant_model.generation_config``
                            only, so they are set there, on a fresh copy per call
``hf-assisted-default``     HF assisted generation with HF's own default schedule
``hf-assisted-conf``        (only when named) γ drafts per round with HF's default confidence cut
``hf-assisted-heuristic``   (only when named) γ drafts to start, HF's "heuristic" schedule, reset every call
``hf-lookup``               HF prompt-lookup decoding (γ tokens, n-grams up to 3 like ours); default without --draft
``sd``                      our lossless speculative decoding: the draft model, or prompt lookup without --draft
``viasd:<name>``            a tuned profile, loaded with ``runtime.load`` on the already-loaded models
``viasd+recheck:<name>``    the same profile with ``recheck`` on (lossless VIA-SD)
==========================  ===================================================================================

Modules, one job each:

- :mod:`.settings`: the flags as :class:`BenchSettings`, checked before anything slow;
- :mod:`.methods`: planning and building the methods, the HF workarounds, the interleaved runner;
- :mod:`.contention`: how busy the rest of the machine was during each run, and waiting for quiet;
- :mod:`.scoring`: speed, fidelity (agreement, greedy agreement), task accuracy (final number, HumanEval);
- :mod:`.report`: ``bench.md`` and ``bench.html`` (offline Plotly, the dashboard's page shell) from the result;
- :mod:`.run`: one run from prompts to reports (:func:`run_bench`), with the host's matrix ISA in every report;
- :mod:`.cli`: the ``viasd-tune bench`` sub-command.
"""

from .cli import add_bench_command, cmd_bench
from .run import run_bench
from .settings import BenchSettings

__all__ = ["BenchSettings", "add_bench_command", "cmd_bench", "run_bench"]
