"""Pre-flight's warning about a Dask scheduler on plain tcp://.

Whoever reaches such a scheduler's port needs no credential to send it work: it runs their
code on the workers (and on the scheduler itself) as the users who started them, with the
AWS, MLflow and Prefect credentials in their environment, and a `dask worker` anyone starts
joins the cluster and can be taken as a DDP rank. The clusters a flow starts use TLS unless
turned off; an existing scheduler (DDPFLOW_CLUSTER=address) keeps whatever it was started
with, so pre-flight says so, once per scheduler and process (a sweep runs pre-flight for
every trial).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)
_warned: set[str] = set()

PLAIN_TCP_WARNING = (
    "Dask scheduler %s takes plain tcp:// without credentials: anyone who reaches it runs "
    "code on it and its workers as the users they run as, with their credentials (AWS, "
    "MLflow, Prefect), and a worker anyone starts can join and become a DDP rank. Use a "
    "scheduler with TLS (tls://; docs/security.md) or make sure only you can reach its port."
)


def warn_if_plain_tcp(address: str) -> bool:
    """Log the warning for a tcp:// `address` the first time it is seen; whether it did."""
    if not address.startswith("tcp://") or address in _warned:
        return False
    _warned.add(address)
    log.warning(PLAIN_TCP_WARNING, address)
    return True
