"""The worker loop: run trials one at a time until the study holds ``--trials`` decoded ones, counting every
worker's, failing a trial cleanly when its objective raises, and stopping when the replays stop finding
anything worth decoding."""

from __future__ import annotations

import collections
import logging
import os
import socket
import time
import warnings

import optuna
from tqdm.auto import tqdm

from .. import host
from ..credentials import scrub
from ..errors import UserError
from .records import TrialRecord
from .screen import finite
from .settings import SearchSettings
from .storage import env_seconds

log = logging.getLogger(__name__)
REPLAYS_PER_DECODE = 20  # at most this many finished trials per real decode asked for (--trials), then stop
MIN_REPLAYS = 100
# Stop once this many finished trials in a row were screened out: the sampler keeps proposing what the measured
# front already beats. A replay costs seconds to half a minute on a CPU, so without this the default search
# (nothing on SmolLM2 beats prompt lookup) spent 40 min replaying 240 dominated trials.
STALE_REPLAYS = 25
POLL_S = 0.5  # how often a worker with nothing to start re-reads the study


def _retried(trial: optuna.trial.FrozenTrial) -> bool:
    """A retry queued for a trial whose worker died (its heartbeat went stale); storage.RetryStaleTrial marks it
    as Optuna's callback does."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.storages.RetryHeartbeatStaleTrialCallback.retried_trial_number(trial) is not None


def _guarded(objective):
    """The objective, recording who ran each trial and why one failed: an exception (or NaN objectives) fails
    that trial with ``fail_reason`` in its user attrs and the search goes on; Ctrl-C fails the running trial
    with its reason too (not left RUNNING) and then stops the search."""

    def run(trial: optuna.Trial) -> tuple[float, float]:
        TrialRecord(worker=f"{socket.gethostname()}:{os.getpid()}").write(trial)
        try:
            values = objective(trial)
            host.release_memory()
            TrialRecord(memory_gb=dict(zip(("resident", "peak"), host.memory_gb(), strict=True))).write(trial)
            if not all(map(finite, values)):
                raise RuntimeError(f"non-finite objective values {values}")
            return values
        except KeyboardInterrupt:
            TrialRecord(fail_reason="interrupted (Ctrl-C / SIGINT)").write(trial)
            raise
        except Exception as e:
            reason = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"[:500]
            reason = scrub(reason, [getattr(trial.storage, "url", None)])  # stored in the study: no password
            TrialRecord(fail_reason=reason).write(trial)
            log.warning("trial %d failed: %s", trial.number, reason, exc_info=log.isEnabledFor(logging.INFO))
            raise

    return run


def _reason(last: list[optuna.trial.FrozenTrial]) -> str:
    return (TrialRecord.read(last[0]).fail_reason or "?") if last else "taken over by another worker"


def _screened_in_a_row(trials: list[optuna.trial.FrozenTrial]) -> int:
    """How many of the latest finished trials, counting back from the newest, were replayed and not decoded."""
    n = 0
    for t in sorted(trials, key=lambda t: t.number, reverse=True):
        if t.state != optuna.trial.TrialState.COMPLETE:
            continue
        if TrialRecord.read(t).measured:
            break
        n += 1
    return n


def _patience(trials: list[optuna.trial.FrozenTrial]) -> float:
    """How long to wait for other workers' running trials when nothing changes: a live worker's trial ends
    within a few trial durations, a dead one's goes stale within the grace period; one killed before its
    first heartbeat does neither and must not hold this worker forever."""
    spans = [
        (t.datetime_complete - t.datetime_start).total_seconds()
        for t in trials
        if t.datetime_complete and t.datetime_start
    ]
    return env_seconds("VIASD_GRACE_PERIOD", 90) + 60 + 3 * max(spans, default=0.0)


def optimize(study: optuna.Study, objective, s: SearchSettings) -> None:
    """Run trials until the study holds ``s.trials`` decoded ones (measured: replayed trials that were not worth
    decoding do not count), counting every worker's, or until timeout, or until ``REPLAYS_PER_DECODE`` finished
    trials per decode asked for (at least ``MIN_REPLAYS``) found too few worth decoding, or once the last
    ``STALE_REPLAYS`` finished trials were all screened out.

    One trial per ``study.optimize`` call, so each start re-reads the study: a trial another worker is running
    counts as on its way (no overshoot); a trial whose worker died is failed once its heartbeat is stale and
    re-queued (storage.RetryStaleTrial), and such a retry is run even past the count, the study owes
    it; a worker with nothing left to start waits for the others' running trials, so none is left RUNNING and
    the exporting process sees every result. Failed trials do not count, so they are replaced.
    """
    TS = optuna.trial.TrialState
    debug = log.isEnabledFor(logging.INFO)
    optuna.logging.set_verbosity(optuna.logging.WARNING if debug else optuna.logging.ERROR)  # we log failures
    bar = tqdm(total=s.trials, desc="decoded", disable=not s.progress, unit="trial")
    max_finished = max(MIN_REPLAYS, REPLAYS_PER_DECODE * s.trials)
    start, ran, failed_in_a_row, last = time.time(), 0, 0, []
    progress, idle_since = None, time.time()
    guarded = _guarded(objective)
    try:
        while True:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                optuna.storages.fail_stale_trials(study)  # a dead worker's trial → FAIL + a WAITING retry
            trials = study.get_trials(deepcopy=False)
            n = collections.Counter(t.state for t in trials)
            finished, running = n[TS.COMPLETE] + n[TS.PRUNED], n[TS.RUNNING]
            records = [TrialRecord.read(t) for t in trials]
            done = sum(
                1 for t, r in zip(trials, records, strict=True) if t.state == TS.COMPLETE and r.measured
            )
            retry = any(t.state == TS.WAITING and _retried(t) for t in trials)
            if (done, running, len(trials)) != progress:
                progress, idle_since = (done, running, len(trials)), time.time()
            best = [
                t.values[0]
                for t, r in zip(trials, records, strict=True)
                if t.state == TS.COMPLETE and r.feasible and r.measured
            ]
            bar.n = min(done, s.trials)
            bar.set_postfix(
                replayed=finished, best_speedup=f"{max(best):.2f}x" if best else "-", refresh=False
            )
            bar.refresh()
            if s.timeout is not None and time.time() - start >= s.timeout:
                break
            stale = _screened_in_a_row(trials)
            more = done + running < s.trials and finished + running < max_finished and stale < STALE_REPLAYS
            if more or retry:
                last.clear()
                try:
                    study.optimize(
                        guarded, n_trials=1, catch=(Exception,), callbacks=[lambda _, t: last.append(t)]
                    )
                except (optuna.exceptions.UpdateFinishedTrialError, ValueError) as e:
                    # This worker stalled past the grace period, so another one failed its trial as stale
                    # and re-queued it; the retry carries the work, this result is dropped.
                    if isinstance(e, ValueError) and not str(e).startswith("Cannot tell a"):
                        raise
                    log.warning("a trial of this worker was taken over by another (heartbeat stale)")
                ran += 1
                failed_in_a_row = failed_in_a_row + 1 if not last or last[0].state == TS.FAIL else 0
                if failed_in_a_row >= max(s.trials, 3):
                    raise UserError(
                        f"the last {failed_in_a_row} trials all failed (last: {_reason(last)}); "
                        "each failed trial's fail_reason user attr says why, --debug shows tracebacks"
                    )
            elif running and time.time() - idle_since < _patience(trials):
                time.sleep(POLL_S)  # the last trials are other workers'; wait so none is left RUNNING
            else:
                if running:
                    log.warning("not waiting longer for %d trial(s) RUNNING without progress", running)
                break
    except KeyboardInterrupt:
        bar.close()  # so the message does not land inside the progress bar
        log.warning(
            "interrupted: finished trials stay in study %r; re-run the same command to resume, or run "
            "`viasd-tune export` for the best profile so far",
            study.study_name,
        )
        raise
    finally:
        bar.close()
    if ran == 0 and done >= s.trials:
        log.warning("study already has %d decoded trials; exporting", done)
    elif done < s.trials and stale >= STALE_REPLAYS:
        log.warning(
            "stopped: the last %d replayed trials could not enter the measured front; %d of --trials %d were "
            "worth decoding for real",
            stale,
            done,
            s.trials,
        )
    elif done < s.trials and finished >= max_finished:
        log.warning(
            "stopped after %d replayed trials: only %d were worth decoding for real (--trials %d)",
            finished,
            done,
            s.trials,
        )
    log.info("search ran %.0f s", time.time() - start)
