"""``viasd-tune bench``: our decoders and tuned VIA-SD profiles against Hugging Face ``generate``, per task group.

Every method decodes the same prompts with the same models, dtype and device, greedy, interleaved: for every
(repeat, prompt) each method runs once and the method order rotates, so no method always runs first (a warm
cache or a noisy neighbour then hits all methods alike). One untimed warm-up per method comes first.

``hf`` always runs: it is the baseline every speedup is measured against. The methods (``ar``, ``sd``, the HF
assisted-generation variants, ``hf-lookup``, ``viasd:<name>``, ``viasd+recheck:<name>``) are listed once, with
what each runs, in docs/bench.md; :mod:`.methods` defines them.

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
