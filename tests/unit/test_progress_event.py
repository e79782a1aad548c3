"""The one progress event type (ddpflow.distributed.progress.Progress): what a rank sends
must always travel as a Dask event, so a value Dask cannot send fails at the sender's call."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch

from ddpflow.distributed.progress import Progress, line_subscriber


def test_numbers_become_plain_numbers_that_travel():
    progress = Progress(step=np.int64(3), total_steps=10, train_loss=torch.tensor(0.5))
    assert type(progress.step) is int and type(progress.train_loss) is float
    # As Dask sends an event: msgpack, which takes no tensor or numpy scalar.
    assert Progress.from_event(msgpack.unpackb(msgpack.packb(progress.to_event()))) == progress


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"step": "three"}, r"Progress\(step='three'\): step must be a number or None"),
        ({"val_loss": [1.0]}, r"Progress\(val_loss=\[1.0\]\): val_loss must be a number"),
        ({"line": 42}, r"Progress\(line=42\): line must be a str or None"),
    ],
)
def test_a_value_that_cannot_travel_fails_at_the_call_naming_the_field(fields, message):
    with pytest.raises(TypeError, match=message):
        Progress(**fields)


def test_the_line_subscriber_passes_only_lines():
    lines: list[str] = []
    subscriber = line_subscriber(lines.append)
    for event in (Progress(line="a"), Progress(step=1, total_steps=2), Progress("b", 2, 2)):
        subscriber(event)
    assert lines == ["a", "b"]
