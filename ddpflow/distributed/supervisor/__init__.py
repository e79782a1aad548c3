"""The supervisor: the launcher's watch over a running rank group, and what it does when the
group stops. One concept per file:

- watch: the group started, its ranks' tasks, its workers still there; a failed rank, a
  lost worker or a stall fails the whole group at once;
- heartbeats: each rank notes its steps on its worker; the launcher asks how long ago;
- stuck_ranks: a failed group's ranks still running on their workers are ended;
- leaving: a worker asked to leave stops its group first; the launcher waits for that stop;
- graceful_stop: the worker side of a stop: SIGTERM, a closing worker or nanny, the stop
  request the ranks read at their control steps;
- growth: workers that joined and stayed make the group grow;
- relaunch: heal the cluster and relaunch the group, up to max_restarts;
- failures: the kinds of failure, a rank's failure, and the order causes are named in;
- classify: the kind of a rank's exception, decided once, where the launcher reads it;
- policy: what the launcher does next, a function of the failures' kinds (one table);
- wording: every cause's words, and nothing else: no decision reads them;
- timings: every poll interval, question timeout and grace period, in one dataclass.
"""
