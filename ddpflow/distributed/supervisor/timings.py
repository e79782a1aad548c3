"""Every time the supervisor waits for, polls at, or gives up after: one dataclass.

The launcher's own loops and questions run in the launching process; the worker side's
(marked "worker") reach the workers in the graceful-stop plugins the launcher registers,
once per cluster (a plugin registered again under its name is not replaced). A caller
overrides any of them, tests shorter ones: launch(..., supervision=SupervisionConfig(...)).

How long a relaunch waits for lost workers and how long a newcomer must stay before a
group grows onto it are the run's own settings (DDPFLOW_HEAL_TIMEOUT_S, DDPFLOW_GROW_SETTLE_S:
ddpflow.config), given to launch_with_restarts as heal_timeout_s and settle_s.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SupervisionConfig:
    """Seconds, each with why it is what it is."""

    # Watching a running group.
    # How often the launcher looks at its ranks' tasks (and at stuck ranks, leavers): a failed
    # rank is acted on within this.
    poll_s: float = 0.25
    # How often it asks the scheduler for the group's workers: a lost worker is named within it.
    worker_check_s: float = 1.0
    # The most between two asks for the ranks' progress (stall_check_s: a twentieth of the
    # rank timeout, at least worker_check_s): a stall is named at most this late.
    max_stall_check_s: float = 10.0
    # A rank's error can arrive before the scheduler has dropped its dead peer's worker: the
    # dead worker is looked for this long, so it is named and not only the peer's error.
    lost_peer_grace_s: float = 3.0
    # A question to the scheduler (its workers, its events): it answers in milliseconds
    # unless it is gone.
    scheduler_timeout_s: float = 30.0
    # A question to a running worker (its ranks' progress, whether a rank still runs): a live
    # worker answers in milliseconds; a hung or cut-off one never does.
    ask_timeout_s: float = 5.0
    # A question to a worker before its rank starts: a fresh worker imports torch (and may
    # initialise CUDA) on its first question, which takes seconds.
    start_ask_timeout_s: float = 60.0
    # How often a launch that waits for workers other groups hold tries to reserve them again.
    reserve_poll_s: float = 1.0

    # Workers asked to leave.
    # A worker the scheduler removed on request posts its stop notice within milliseconds
    # (10 ms measured after retire_workers); a killed worker never does: this long, no longer.
    notice_s: float = 3.0
    # How often the launcher looks for those notices, and for the group's stop.
    notice_poll_s: float = 0.1
    # Event times are the scheduler's clock: a little slack for another host's.
    clock_slack_s: float = 30.0
    # (worker) A rank asked to stop gets this long before its process goes anyway: Slurm's
    # KillWait and Kubernetes' terminationGracePeriodSeconds default to 30 s, then SIGKILL.
    grace_s: float = 25.0
    # (worker) After its rank returned, the process lets the StopRequested reach the
    # scheduler before it goes: the launcher then names the stop, not a lost worker.
    result_delay_s: float = 1.0
    # (worker) How often a closing worker or nanny looks whether its ranks have stopped.
    stop_poll_s: float = 0.1
    # (worker) A nanny's question to its worker process: milliseconds unless it is wedged.
    stop_ask_timeout_s: float = 10.0
    # Beyond grace_s and result_delay_s, for a leaver's exit to reach the scheduler.
    leave_slack_s: float = 5.0

    # After a failure.
    # A rank that raised returns within milliseconds; one still running after this is stuck
    # (in gloo's C++ code, which a cancel cannot stop) and its worker process is ended.
    stuck_grace_s: float = 3.0
    # A nanny's fresh worker registers in seconds (it imports torch): the ended workers'
    # replacements are waited for this long.
    replace_timeout_s: float = 30.0
    # Healing: a worker that does not run a trivial function within this is hung.
    ping_timeout_s: float = 5.0
    # Healing: a nanny restarts a hung worker in seconds; a host cut off from the network
    # never answers, and waiting longer only delays the relaunch on the workers there are.
    restart_timeout_s: float = 30.0

    # Growing: how often the grow watch lists the cluster's workers.
    grow_poll_s: float = 1.0

    @property
    def leave_wait_s(self) -> float:
        """The longest a leaver takes from its stop request to being gone."""
        return self.grace_s + self.result_delay_s + self.leave_slack_s


DEFAULT_SUPERVISION = SupervisionConfig()
