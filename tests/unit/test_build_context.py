"""The Docker image's build context holds no credential (.dockerignore at the repository root).

No Docker engine here, so the context is computed the way the Docker SDK computes what it
sends to the engine (`docker.api.build`: the .dockerignore lines, then
`docker.utils.build.exclude_paths`, a port of Docker's own pattern matcher) over a copy of
the repository into which the files a quick start and the Kubernetes recipe leave behind are
planted: ddpflow.env, Dask's TLS key, a .venv, mlruns/, .git. None may be in the context, and
everything the Dockerfile copies must be.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

build = pytest.importorskip("docker.utils.build")

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = "infra/docker/Dockerfile"

# What a user's checkout holds after the compose quick start, `python -m infra.certs
# dask-tls` (the Kubernetes recipe) and a few local runs: credentials first.
SECRETS = (
    "infra/docker/ddpflow.env",
    "infra/docker/s3.env",
    "infra/docker/tls/key.pem",
    "infra/docker/tls/cert.pem",
    "infra/docker/tls/ca.pem",
    "infra/docker/https/key.pem",
    "dask-tls/key.pem",
    ".env",
    "flows/.env",
    "ddpflow/stray-key.pem",
    ".stack/prefect/auth",
    ".git/config",
    ".netrc",
    # `python -m infra.stack up --dir infra/x` (or any folder the Dockerfile copies): what
    # the stack writes, under names no pattern of credentials catches.
    "infra/x/env.sh",
    "infra/x/state.json",
    "infra/x/secrets/seaweedfs/identities.json",
    "infra/x/secrets/prefect/auth",
    "infra/x/prefect/prefect.db",
    "ddpflow/x/state.json",
    "deployments/x/env.sh",
    "flows/notes.txt",
)
LOCAL_JUNK = (
    ".venv/bin/python",
    "mlruns/0/meta.yaml",
    "artifacts/model.pt",
    "mlflow.db",
    "ddpflow/__pycache__/x.cpython-311.pyc",
    ".pytest_cache/v/cache",
    "dask-worker-space/global.lock",
)


# Not copied into the test's checkout (LOCAL_JUNK plants each kind again).
COPY_SKIPS = (
    ".git",
    "__pycache__",
    ".venv",
    "artifacts",
    "mlartifacts",
    "mlruns",
    ".pytest_cache",
    "dask-scratch-space",
    "dask-worker-space",
)


def _dockerignore_patterns(root: Path) -> list[str]:
    """The .dockerignore lines as docker.api.build reads them."""
    lines = (line.strip() for line in (root / ".dockerignore").read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def build_context(root: Path) -> set[str]:
    """The files (not folders) `docker build -f infra/docker/Dockerfile root` would send."""
    kept = build.exclude_paths(str(root), _dockerignore_patterns(root), dockerfile=DOCKERFILE)
    return {path for path in kept if (root / path).is_file()}


def _copied_sources() -> list[str]:
    """What the Dockerfile's COPY lines take from the context."""
    sources = []
    for line in (REPO / DOCKERFILE).read_text().splitlines():
        if match := re.match(r"COPY\s+(?!--from)(.+)\s+\S+$", line):
            sources += match.group(1).split()
    return sources


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A copy of the repository with a user's credentials and local outputs planted in it."""
    root = tmp_path / "repo"
    # The checkout's own local outputs stay behind: .venv alone is 13 GB (torch's CUDA
    # wheels), which filled the disk when each test copied it. The same kinds of paths are
    # planted below, small, so their exclusion is still checked.
    shutil.copytree(REPO, root, ignore=shutil.ignore_patterns(*COPY_SKIPS))
    for name in (*SECRETS, *LOCAL_JUNK):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("AWS_SECRET_ACCESS_KEY=planted-by-the-test\n")
    return root


def test_no_credential_or_local_output_is_in_the_build_context(checkout: Path) -> None:
    context = build_context(checkout)
    leaked = sorted(name for name in (*SECRETS, *LOCAL_JUNK) if name in context)
    assert not leaked, f"these would be baked into the image: {leaked}"
    for path in context:  # whatever name a key is saved under
        assert "planted-by-the-test" not in (checkout / path).read_text(errors="replace"), path


def test_the_build_context_holds_what_the_dockerfile_copies(checkout: Path) -> None:
    context = build_context(checkout)
    for source in _copied_sources():
        under = [p for p in context if p == source or p.startswith(f"{source}/")]
        assert under, f"the Dockerfile copies {source}, which .dockerignore leaves out"
    tracked_code = [
        p.relative_to(checkout).as_posix()
        for folder in ("ddpflow", "flows", "tasks", "infra")
        for p in (checkout / folder).rglob("*.py")
    ]
    missing = sorted(set(tracked_code) - context)
    assert not missing, f"left out of the image (a line in .dockerignore per folder): {missing}"
    data = ("ddpflow/workloads/charlm/data/census_names.json", "deployments/prefect.yaml")
    for name in (*data, "infra/jobqueue/slurm-gpu.json", "infra/kubernetes/daskcluster.yaml"):
        assert name in context, name


def test_the_matcher_follows_dockers_rules(tmp_path: Path) -> None:
    """The rules .dockerignore relies on, so a passing test above means Docker agrees."""
    for name in ("a.pem", "sub/b.pem", "tls/x", "keep/tls/y", "keep/z.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    (tmp_path / ".dockerignore").write_text("*.pem\ntls\n")
    root_only = build_context(tmp_path)
    assert "sub/b.pem" in root_only and "keep/tls/y" in root_only  # `*.pem`: the root only
    assert "a.pem" not in root_only and "tls/x" not in root_only
    (tmp_path / ".dockerignore").write_text("*\n!keep\n**/tls\n**/*.pem\n")
    allow_list = build_context(tmp_path) - {".dockerignore"}  # Docker always sends it
    assert allow_list == {"keep/z.py"}, allow_list  # the last matching line wins
