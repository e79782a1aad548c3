"""The speed-settings benchmark adds its entry to the results file and keeps the others."""

from __future__ import annotations

import json

from bench.speed_settings import merge_into


def test_merge_keeps_the_other_benchmarks_entries(tmp_path) -> None:
    path = tmp_path / "latest.json"
    path.write_text(json.dumps({"mode": "full", "results": [{"benchmark": "formatting"}]}))
    merge_into(path, {"results": {"images/bf16": {"ratio_to_fp32": 0.5}}})
    merge_into(path, {"results": {"images/channels_last": {"ratio_to_fp32": 0.9}}})
    report = json.loads(path.read_text())
    assert report["results"] == [{"benchmark": "formatting"}]
    assert report["speed_settings"] == {"results": {"images/channels_last": {"ratio_to_fp32": 0.9}}}
