"""Fresh credentials for the compose stack: `python -m infra.compose_secrets infra/docker`.

Writes DIR/ddpflow.env and DIR/s3.env from the *.example files beside compose.yaml, each
placeholder replaced by its own random value, mode 0600 from the first byte (a `cp` of the
example would leave them readable by every user of the host). An existing file is kept
(MLflow's admin password is set only when its user DB is first made, so new values would lock
the clients out); --force replaces it.
"""

from __future__ import annotations

import argparse
import re
import secrets
import sys
from pathlib import Path

from infra.compose_check import PLACEHOLDER, problems, read_env_file
from infra.private import write_private

EXAMPLES = Path(__file__).resolve().parent / "docker"
FILES = ("ddpflow.env", "s3.env")
_PLACEHOLDER_VALUE = re.compile(rf"{PLACEHOLDER}[\w-]*")


def fresh(example: str) -> str:
    """The example's text with each placeholder a new random value (192 bits, URL-safe)."""
    return _PLACEHOLDER_VALUE.sub(lambda _: secrets.token_urlsafe(24), example)


def write_env_files(folder: Path, force: bool = False) -> list[Path]:
    """DIR/ddpflow.env and DIR/s3.env, fresh and 0600; existing ones kept unless force."""
    written = []
    for name in FILES:
        target = Path(folder) / name
        if target.exists() and not force:
            continue
        write_private(target, fresh((EXAMPLES / f"{name}.example").read_text()))
        written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.compose_secrets", description=__doc__)
    parser.add_argument("dir", type=Path, help="the folder of compose.yaml (infra/docker)")
    parser.add_argument("--force", action="store_true", help="replace existing files")
    args = parser.parse_args(argv)
    written = write_env_files(args.dir, args.force)
    for path in written:
        print(f"wrote {path} (mode 0600)")
    kept = [Path(args.dir) / n for n in FILES if Path(args.dir) / n not in written]
    for path in kept:
        print(f"kept {path} (exists; --force replaces it)")
    env: dict[str, str] = {}
    for name in FILES:
        env.update(read_env_file(Path(args.dir) / name))
    found = problems(env)
    for line in found:
        print(f"compose_secrets: {line}", file=sys.stderr)
    return 2 if found else 0


if __name__ == "__main__":
    sys.exit(main())
