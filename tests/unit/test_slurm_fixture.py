"""The Slurm fixture's policy where it cannot run: skip on a developer machine, fail on CI,
where a skip would hide that the slurm tests never ran."""

from __future__ import annotations

import os

import pytest

from tests.helpers import slurm_cluster


def test_without_slurm_and_root_it_skips_outside_ci_and_fails_on_ci(monkeypatch):
    monkeypatch.setattr(slurm_cluster, "daemon", lambda name: None)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="needs root"):
        slurm_cluster.ensure_installed()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="Slurm tests cannot run: .*needs root"):
        slurm_cluster.ensure_installed()


def test_without_apt_get_it_skips(monkeypatch):
    monkeypatch.setattr(slurm_cluster, "daemon", lambda name: None)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(slurm_cluster.shutil, "which", lambda name, **_: None)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no apt-get"):
        slurm_cluster.ensure_installed()
