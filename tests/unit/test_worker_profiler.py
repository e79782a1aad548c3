"""ddpflow.cluster.profiler outside a Dask worker: registration also runs in the flow's own
process and in a fresh interpreter, where there is no profiler to pause. (In a worker:
integration/test_external_cluster.py::test_registrations_on_a_worker_whose_profiler_samples_each_register.)"""

from ddpflow.cluster.profiler import worker_profiler_paused


def test_outside_a_dask_worker_nothing_is_paused_and_the_block_runs() -> None:
    ran = []
    with worker_profiler_paused() as paused:
        ran.append(True)
    assert paused is False
    assert ran == [True]
