"""How a launch's timeline is read: from rank 0's 20-step logs and the flow's log lines.

See bench/launch.py for what the figures mean; this module only turns timestamps into them.
"""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass

from bench.common import median

BATCH_SIZE = 512
WORLD_SIZE = 2
LOG_EVERY = 20

# First log line of each stage of the flow, as Prefect and Dask print them.
MILESTONES = {
    "Prefect API starting": "Starting temporary server",
    "flow body starts": "Beginning flow run",
    "Dask cluster requested": "Creating a new Dask cluster",
    "DDP ranks dispatched": "Run out-of-band function 'reserve_store_port'",
}
LOG_LINE = re.compile(r"^(\d\d):(\d\d):(\d\d)\.(\d{3}) \| ")


@dataclass(frozen=True)
class Timeline:
    """What one launch measured, in seconds after its launch."""

    first_step_s: float  # estimated as bench/launch.py's docstring describes
    training_start_s: float
    first_log_s: float
    steady_samples_per_s: float
    epoch_samples_per_s: float
    total_s: float
    direct_first_step_s: float | None = None  # torchrun only: stamped by an optimizer hook


def timeline(
    launch_ts: float,
    logs: list[tuple[float, float]],
    epoch_rate: float,
    world_size: int = WORLD_SIZE,
) -> Timeline:
    """From (timestamp, samples_per_s) of each 20-step window, in step order."""
    first_ts, first_rate = logs[0]
    steady = median([rate for _, rate in logs[1:]]) if len(logs) > 1 else first_rate
    global_batch = BATCH_SIZE * world_size
    start = first_ts - LOG_EVERY * global_batch / first_rate
    return Timeline(
        first_step_s=start + global_batch / steady - launch_ts,
        training_start_s=start - launch_ts,
        first_log_s=first_ts - launch_ts,
        steady_samples_per_s=steady,
        epoch_samples_per_s=epoch_rate,
        total_s=float("nan"),
    )


def stages(log_text: str, launch_ts: float) -> dict[str, float]:
    """Seconds after launch of the first log line of each stage (local-time HH:MM:SS.mmm)."""
    launch = datetime.datetime.fromtimestamp(launch_ts)
    found: dict[str, float] = {}
    for line in log_text.splitlines():
        match = LOG_LINE.match(line)
        for name, marker in MILESTONES.items():
            if match and name not in found and marker in line:
                h, m, s, ms = (int(g) for g in match.groups())
                stamp = launch.replace(hour=h, minute=m, second=s, microsecond=ms * 1000)
                if stamp < launch - datetime.timedelta(minutes=1):  # crossed midnight
                    stamp += datetime.timedelta(days=1)
                found[name] = stamp.timestamp() - launch_ts
    return found
