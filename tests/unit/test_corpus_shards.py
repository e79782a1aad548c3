"""The corpus formatted into shards (ddpflow.workloads.charlm.shard_format), in one
process: the same windows as the in-memory format, reuse, a deleted shard."""

from __future__ import annotations

import json
import os

import torch

from ddpflow.shards.index import read_index
from ddpflow.workloads.charlm.corpus import parse_names, split_holdout
from ddpflow.workloads.charlm.data import open_windows
from ddpflow.workloads.charlm.formatting import format_names, split_xy
from ddpflow.workloads.charlm.shard_format import (
    format_name_chunk,
    index_corpus_shards,
    plan_corpus_shards,
    reusable_corpus,
    write_train_names,
)

NAMES = [f"name{chr(97 + i % 26)}{chr(97 + i // 26 % 26)}" for i in range(600)]


def _format(tmp_path):  # noqa: ANN202
    raw = tmp_path / "names.json"
    raw.write_text(json.dumps(NAMES))
    plan = plan_corpus_shards(str(raw), str(tmp_path / "store"), 0.1, shard_mb=0.005)
    assert not (tmp_path / "store").exists(), "a plan writes nothing: auto may not shard"
    write_train_names(plan.train_names_uri, plan.train_names())
    results = [format_name_chunk(plan.store, chunk) for chunk in plan.chunks]
    return plan, index_corpus_shards(plan.without_chunks(), results)


def test_the_shards_hold_the_windows_of_the_in_memory_format_in_order(tmp_path):
    plan, corpus = _format(tmp_path)
    assert len(plan.chunks) > 4
    names, _ = parse_names(json.dumps(NAMES).encode(), "names.json")
    train, val = split_holdout(names, 0.1)
    for uri, split in ((corpus.train_uri, train), (corpus.val_uri, val)):
        stream = open_windows(uri)
        x, y = stream.batch(torch.arange(len(stream)))
        expected_x, expected_y = split_xy(format_names(split))
        assert torch.equal(x, expected_x) and torch.equal(y, expected_y)
    assert corpus.num_train_names == len(train) and corpus.num_val_names == len(val)
    assert set(
        json.loads(
            (tmp_path / "store")
            .joinpath("data", "corpus-shards", os.path.basename(corpus.train_names_uri))
            .read_text()
        )
    ) == set(train)


def test_a_rerun_reuses_the_shards_and_a_deleted_one_is_not_reused(tmp_path):
    plan, corpus = _format(tmp_path)
    assert reusable_corpus(plan.without_chunks()) == corpus.__class__(
        **{**corpus.__dict__, "reused": True}
    )
    index = read_index(corpus.val_uri)
    os.remove(index.uri(index.shards[0]))
    assert reusable_corpus(plan.without_chunks()) is None
