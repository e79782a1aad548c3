"""MinIO's place in the compose stack under test: moto's S3, authenticating, run in the
project's image (the test's derived image adds moto).

MinIO's images (and its binary) cannot be fetched on the machines the suite runs on, so the
compose test swaps this in for the `minio` service and keeps the recipe's contract: the keys
of MINIO_ROOT_USER / MINIO_ROOT_PASSWORD (minio.env) are an administrator's, the workers' key
(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, ddpflow.env) is a user of its own whose policy
covers the bucket `ddpflow` alone (infra/docker/minio-ddpflow-policy.json), and no other key
is accepted: moto checks every request's signature and policy from the first one
(INITIAL_NO_AUTH_ACTION_COUNT=0).

moto's IAM makes random keys, so the two users' keys are set on moto's own records, in
this process, before the server answers anyone.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"  # before moto reads its settings

from moto.core import DEFAULT_ACCOUNT_ID  # noqa: E402
from moto.iam.models import iam_backends  # noqa: E402
from moto.s3.models import s3_backends  # noqa: E402
from moto.server import ThreadedMotoServer  # noqa: E402

ADMIN_POLICY = {
    "Version": "2012-10-17",
    "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
}


def add_user(name: str, key_id: str, secret: str, policy: dict) -> None:
    iam = iam_backends[DEFAULT_ACCOUNT_ID]["aws"]
    iam.create_user(None, name, path="/", tags=None)
    iam.put_user_policy(name, f"{name}-policy", json.dumps(policy))
    key = iam.create_access_key(name)
    key.access_key_id, key.secret_access_key = key_id, secret


def main() -> None:
    bucket, policy_file = sys.argv[1], sys.argv[2]
    with open(policy_file) as f:
        worker_policy = json.load(f)
    add_user(
        "admin", os.environ["MINIO_ROOT_USER"], os.environ["MINIO_ROOT_PASSWORD"], ADMIN_POLICY
    )
    add_user(
        "ddpflow-worker",
        os.environ["AWS_ACCESS_KEY_ID"],
        os.environ["AWS_SECRET_ACCESS_KEY"],
        worker_policy,
    )
    s3_backends[DEFAULT_ACCOUNT_ID]["aws"].create_bucket(bucket, "us-east-1")
    port = int(os.environ.get("S3_STANDIN_PORT", "9000"))
    server = ThreadedMotoServer(ip_address="0.0.0.0", port=port, verbose=False)
    server.start()
    print(f"S3 stand-in on :{port}, bucket {bucket}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    server.stop()


if __name__ == "__main__":
    main()
