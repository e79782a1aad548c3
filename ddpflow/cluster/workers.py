"""What every Dask worker of a training is started with: its settings, as Dask config for the
workers ddpflow starts and as environment variables for those it does not, and its resources."""

from __future__ import annotations

PRE_SPAWN_ENVIRON = "distributed.nanny.pre-spawn-environ"
# Set before workers start (the nanny hands its config to the worker process):
# - daemon=False lets a rank start DataLoader processes (daemonic processes cannot fork);
# - the profiler (stacks sampled every 10 ms) and Dask's health checks wake the worker's event
#   loop beside a training rank, taking the GIL and a core from it (bench/worker_overhead.py).
#   The checks stay on, less often: the tick (20 ms by default) still sees a loop blocked past
#   its 3 s limit, the memory monitor (100 ms) still spills, pauses and restarts within a
#   second, the system monitor (500 ms) still feeds heartbeats. Heartbeats stay as they are.
WORKER_CONFIG = {
    "distributed.worker.daemon": False,
    "distributed.worker.profile.enabled": False,
    "distributed.admin.tick.interval": "1s",
    "distributed.worker.memory.monitor-interval": "1s",
    "distributed.admin.system-monitor.interval": "2s",
    # The nanny sets MALLOC_TRIM_THRESHOLD_=65536 on its workers. That pins glibc's trim
    # threshold, so every training step returns its large buffers to the kernel and faults
    # them in again: 0.85x torchrun's samples/s with it, 0.99x without (bench/launch.py).
    f"{PRE_SPAWN_ENVIRON}.MALLOC_TRIM_THRESHOLD_": None,
}
# The same settings as environment variables, for `dask worker` processes ddpflow does not
# start itself (the stack, the image, job scripts, pods); a unit test parses them as Dask
# does and compares. Dask lowercases the names of DASK_* variables, so the upper-case
# MALLOC_TRIM_THRESHOLD_ goes inside a dict literal, which Dask merges into the defaults.
WORKER_ENV = {
    "DASK_DISTRIBUTED__WORKER__DAEMON": "False",
    "DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED": "False",
    "DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL": "1s",
    "DASK_DISTRIBUTED__WORKER__MEMORY__MONITOR_INTERVAL": "1s",
    "DASK_DISTRIBUTED__ADMIN__SYSTEM_MONITOR__INTERVAL": "2s",
    "DASK_DISTRIBUTED__NANNY__PRE_SPAWN_ENVIRON": "{'MALLOC_TRIM_THRESHOLD_': None}",
}
# ... and the `dask worker` flags: its nannies fork their workers from a server that imported
# torch and MLflow once, as ddpflow's LocalCluster does (ddpflow.cluster.forkserver). A flag,
# not a DASK_DISTRIBUTED__NANNY__PRELOAD variable: `dask worker` hands each nanny its own
# --preload-nanny list, empty when the flag is absent, and a nanny then ignores the setting.
WORKER_CLI_ARGS = ("--preload-nanny", "ddpflow.cluster.forkserver")
# Dask worker resources: a GPU worker declares GPU=1 (`dask worker ... --resources GPU=1`),
# a CPU-only worker beside GPU workers CPU=<threads>; see task_placement.
GPU_RESOURCE = "GPU"
CPU_RESOURCE = "CPU"
