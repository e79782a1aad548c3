"""Prefect tasks for what a user inspects: the digests of a training's input files."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from prefect import task

from ddpflow.tracking.inspection import DatasetRef, dataset_ref


@task(name="describe-datasets")
def describe_datasets(
    inputs: Sequence[tuple[str, str, str, Mapping[str, int | str]]], origin: str | None
) -> list[DatasetRef]:
    """(name, uri, context, profile) per input file -> its DatasetRef with a content digest.

    A task, so the files are read on a worker (near the data), not in the flow process.
    """
    return [
        dataset_ref(name, uri, context, origin, profile) for name, uri, context, profile in inputs
    ]
