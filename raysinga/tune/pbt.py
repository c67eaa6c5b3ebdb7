"""Population-based training whose exploits restart nothing: :class:`InPlacePBT`.

Tune's PBT exploits a trial by pausing it (its process stops, or goes to Tune's actor cache
with ``reuse_actors``) and starting it again from the better trial's checkpoint. Tune hands a
cached process to whichever trial starts next, and caches none once its search algorithm has
made every trial and none waits for one, so with ``reuse_actors`` an exploited trial was seen to
start in a new process, or in another trial's. :class:`InPlacePBT` keeps the running trial: it
chooses and perturbs as PBT does, then tells the trial's own process (an
:func:`~raysinga.tune.in_place` trial) to take the better trial's checkpoint and hyperparameters
before its next step; the trial never stops.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from ray.tune.experiment import Trial
from ray.tune.schedulers import PopulationBasedTraining, TrialScheduler
from ray.tune.schedulers.pbt import _make_experiment_tag

logger = logging.getLogger(__name__)

__all__ = ["InPlacePBT"]


class InPlacePBT(PopulationBasedTraining):
    """Ray Tune's :class:`PopulationBasedTraining` (the same arguments, the same choices),
    exploiting a running :func:`~raysinga.tune.in_place` trial in its process. A trial that is
    paused (synchronous PBT pauses every trial at each perturbation point), or of another
    trainable, is exploited as Tune does it."""

    def on_trial_result(self, tune_controller: Any, trial: Trial, result: dict) -> str:
        """PBT's decision, except that a running trial is not paused for one still pending
        (Tune's asynchronous PBT pauses every reporting trial while any other is pending or
        paused, so that a population larger than the cluster takes turns; a trial whose process
        is slow to start would set every other trial pausing and resuming, each time in any
        process Tune reuses). A population larger than the cluster runs its pending trials as
        others end; one paused still makes the others take turns, as in Tune's PBT."""
        if self._synch:  # a trial that failed is no longer waited for
            return super().on_trial_result(_Unfinished(tune_controller), trial, result)
        decision = super().on_trial_result(tune_controller, trial, result)
        if decision != TrialScheduler.PAUSE:
            return decision
        others = [t for t in tune_controller.get_trials() if t is not trial]
        paused = any(t.status == Trial.PAUSED for t in others)
        return decision if paused else TrialScheduler.CONTINUE

    def choose_trial_to_run(self, tune_controller: Any) -> Trial | None:
        """PBT's choice. Synchronous PBT perturbs when the last live trial reports at the point,
        and until then runs none that has reached it: where that last trial failed or was
        stopped instead, every other would wait for it for ever. They are perturbed then, as
        its report would have done, and go on."""
        chosen = super().choose_trial_to_run(tune_controller)
        if chosen is not None or not self._synch:
            return chosen
        live = _Unfinished(tune_controller).get_live_trials()
        if not live or any(t.status not in (Trial.PAUSED, Trial.PENDING) for t in live):
            return None  # a running trial's report decides
        states = [self._trial_state.get(t) for t in live]
        if any(s is None or not s.last_result for s in states):
            return None
        last = max(live, key=lambda t: self._trial_state[t].last_train_time)
        point = self._next_perturbation_sync
        self.on_trial_result(tune_controller, last, self._trial_state[last].last_result)
        if self._next_perturbation_sync == point:
            return None
        logger.info(
            "[InPlacePBT] the %d live trials waited at %s for a trial that ended: perturbed",
            len(live),
            point,
        )
        return super().choose_trial_to_run(tune_controller)

    def _exploit(self, tune_controller: Any, trial: Trial, trial_to_clone: Trial) -> None:
        actor = trial.temporary_state.ray_actor
        if trial.status != Trial.RUNNING or actor is None or not hasattr(actor, "exploit"):
            super()._exploit(tune_controller, trial, trial_to_clone)
            return
        trial_state = self._trial_state[trial]
        new_state = self._trial_state[trial_to_clone]
        new_config, operations = self._get_new_config(trial, trial_to_clone)
        logger.info(
            "[InPlacePBT] [Exploit] trial %s takes trial %s's state (score %.4f against %.4f) "
            "in its process: %s",
            trial.trial_id,
            trial_to_clone.trial_id,
            new_state.last_score,
            trial_state.last_score,
            operations,
        )
        if self._log_config:
            self._log_config_on_step(trial_state, new_state, trial, trial_to_clone, new_config)
        trial.set_experiment_tag(
            _make_experiment_tag(trial_state.orig_tag, new_config, self._hyperparam_mutations)
        )
        trial.set_config(new_config)
        checkpoint = copy.copy(new_state.last_checkpoint)
        _restore_point(trial, checkpoint, new_state.last_result)
        # the trial's process runs this before the next step Tune asks of it (an actor's calls
        # from one caller run in order); an error there fails that step, and so the trial
        actor.exploit.remote(new_config, checkpoint, new_state.last_result)
        self._num_perturbations += 1
        trial_state.last_perturbation_time = new_state.last_perturbation_time
        trial_state.last_train_time = new_state.last_train_time


class _Unfinished:
    """The Tune controller that PBT's scheduler is handed, except that its live trials leave
    out the trials that failed or ended: Tune counts a failed trial live, and synchronous PBT
    would wait for it to reach the perturbation point."""

    def __init__(self, controller: Any) -> None:
        self._controller = controller

    def get_live_trials(self) -> list[Trial]:
        return [t for t in self._controller.get_live_trials() if not t.is_finished()]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._controller, name)


def _restore_point(trial: Trial, checkpoint: Any, metrics: dict[str, Any]) -> None:
    """Make ``checkpoint`` (the state the trial took) what Tune restores the trial from after
    a failure, as Tune's own exploit does. This reaches into Tune's trial bookkeeping, which
    is not public API; where a Ray version lays it out otherwise, the exploit goes on and says
    so (a failed trial would then restart from its own last checkpoint)."""
    try:
        from ray.train._internal.session import _TrainingResult  # noqa: PLC0415

        manager = trial.run_metadata.checkpoint_manager
        manager._latest_checkpoint_result = _TrainingResult(checkpoint=checkpoint, metrics=metrics)
    except (ImportError, AttributeError, TypeError) as e:
        logger.warning(
            "[InPlacePBT] trial %s: Tune's restore point not moved to the state it took (%s: %s)",
            trial.trial_id,
            type(e).__name__,
            e,
        )
