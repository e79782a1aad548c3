"""A Docker engine and the images the compose test needs, built on this machine.

No image registry is reachable where the suite runs, so nothing is pulled: a Debian base is
made with debootstrap and `docker import`, Python and the host's CA certificates go on it
(pip in a build goes out through the same TLS-inspecting egress as the host's), and the
project's image is built from infra/docker/Dockerfile with that base as BASE_IMAGE. Builds
use the host's network (containers on a bridge have no route out without iptables NAT,
which the engine is started without, to leave the network-namespace tests' rules alone).
Each base image is built once per machine and reused while it exists; the project's image,
which also runs the recipe's S3 server (SeaweedFS), is rebuilt every time (only its code
layers change between runs).

Outside CI a machine without Docker (or without root to install it) skips the test; on CI
(CI=true) that is a failure, as for the Slurm tests.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEBIAN = "local/debian:bookworm"
PYTHON = "local/python:3.11"
NGINX = "local/nginx:bookworm"
PROJECT = "ddpflow:latest"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
CA_FOLDER = Path("/usr/local/share/ca-certificates")


def unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (CI=true: the compose test must run)")
    pytest.skip(reason)


def run(*argv: str, timeout_s: float = 900, **kwargs) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        list(argv), capture_output=True, text=True, timeout=timeout_s, check=False, **kwargs
    )
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{(result.stdout + result.stderr)[-4000:]}")
    return result


def ensure_engine() -> subprocess.Popen | None:
    """A running Docker engine: the one there is, else dockerd started here (returned, for
    the caller to stop), after installing Debian's docker.io/docker-compose if missing."""
    if os.geteuid() != 0 and not shutil.which("docker"):
        unavailable("Docker is not installed and this user cannot install it")
    if not (
        shutil.which("dockerd") and shutil.which("docker-compose") and shutil.which("debootstrap")
    ):
        if not shutil.which("apt-get") or os.geteuid() != 0:
            unavailable("docker.io, docker-compose and debootstrap are needed (apt-get as root)")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        run("apt-get", "update", "-qq", env=env)
        run(
            "apt-get", "install", "-y", "-qq", "docker.io", "docker-compose", "debootstrap", env=env
        )
    if subprocess.run(["docker", "info"], capture_output=True, check=False).returncode == 0:
        return None
    if os.geteuid() != 0:
        unavailable("no Docker engine runs and this user cannot start one")
    log = open(Path(tempfile.gettempdir()) / "ddpflow-test-dockerd.log", "w")  # noqa: SIM115
    engine = subprocess.Popen(
        ["dockerd", "--iptables=false", "--ip6tables=false", "--ip-forward=false"],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # a signal to the test's process group must not stop it
    )
    deadline = time.monotonic() + 60
    while subprocess.run(["docker", "info"], capture_output=True, check=False).returncode != 0:
        if engine.poll() is not None or time.monotonic() > deadline:
            engine.kill()
            raise RuntimeError(f"dockerd did not start: see {log.name}")
        time.sleep(0.5)
    return engine


def _exists(image: str) -> bool:
    return _image_id(image) is not None


def _image_id(image: str) -> str | None:
    found = subprocess.run(
        ["docker", "image", "inspect", "--format", "{{.Id}}", image],
        capture_output=True,
        text=True,
    )
    return found.stdout.strip() if found.returncode == 0 else None


def _build(tag: str, dockerfile: str, context: Path, *args: str) -> None:
    (context / "Dockerfile").write_text(dockerfile)
    # --force-rm: a failed step's container is removed too (by default it stays, 7 GB each).
    run(
        "docker", "build", "--network", "host", "--force-rm", "-q", "-t", tag, *args,
        str(context), timeout_s=1800,
    )  # fmt: skip


def build_images(work: Path) -> None:
    """The base images (once per machine) and the project's image."""
    if not _exists(DEBIAN):
        rootfs = work / "rootfs"
        run("debootstrap", "--variant=minbase", "bookworm", str(rootfs), DEBIAN_MIRROR)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        run("docker", "import", "-", DEBIAN, stdin=tar.stdout)
        tar.wait()
        shutil.rmtree(rootfs, ignore_errors=True)
    if not _exists(PYTHON):
        context = work / "python"
        context.mkdir()
        for cert in CA_FOLDER.glob("*.crt"):
            shutil.copy(cert, context / cert.name)
        has_certs = any(context.glob("*.crt"))
        _build(
            PYTHON,
            f"FROM {DEBIAN}\n"
            + ("COPY *.crt /usr/local/share/ca-certificates/\n" if has_certs else "")
            + "RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "
            "--no-install-recommends python3 python3-venv ca-certificates >/dev/null "
            "&& update-ca-certificates >/dev/null && python3 -m venv /opt/python "
            "&& rm -rf /var/lib/apt/lists/*\n"
            "ENV PATH=/opt/python/bin:$PATH\n",
            context,
        )
    if not _exists(NGINX):
        context = work / "nginx"
        context.mkdir()
        _build(
            NGINX,
            f"FROM {DEBIAN}\n"
            "RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "
            "--no-install-recommends nginx >/dev/null && rm -rf /var/lib/apt/lists/* "
            "&& rm -f /etc/nginx/sites-enabled/default\n"
            'CMD ["nginx", "-g", "daemon off;"]\n',
            context,
        )
    # The image this build replaces: each rebuild (the checkout changed) would leave the
    # previous one behind, untagged, 7 GB each, until the disk is full.
    replaced = _image_id(PROJECT)
    run(
        "docker", "build", "--network", "host", "--force-rm", "-q", "-t", PROJECT,
        "--build-arg", f"BASE_IMAGE={PYTHON}", "-f", "infra/docker/Dockerfile", ".",
        cwd=REPO, timeout_s=1800,
    )  # fmt: skip
    if replaced is not None and replaced != _image_id(PROJECT):
        # Fails, harmlessly, for an image a container still uses: it stays.
        subprocess.run(["docker", "image", "rm", replaced], capture_output=True)


def remove_project(project: str) -> None:
    """Remove what a compose project left (containers, networks, volumes), found by its label
    and removed by id. `docker-compose down` names the project's network, so it cannot remove
    two networks of the same name (which two stacks brought up at once can leave) and fails
    on them, as does the next `up`; by id each goes."""
    label = f"label=com.docker.compose.project={project}"
    for listing, removal in (
        (["ps", "-aq"], ["rm", "-f", "-v"]),
        (["network", "ls", "-q"], ["network", "rm"]),
        (["volume", "ls", "-q"], ["volume", "rm", "-f"]),
    ):
        ids = run("docker", *listing, "--filter", label).stdout.split()
        if ids:
            run("docker", *removal, *ids)
