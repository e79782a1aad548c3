"""The local stack's S3 (moto) takes only the stack's own key, and that key only for its bucket.

moto accepts any key unless `INITIAL_NO_AUTH_ACTION_COUNT` is set; with it, only that many
requests pass unauthenticated, and every later one must be signed with the access key of a
user that moto's IAM knows, and may do only what that user's policies allow. `up` spends
exactly those first requests on the bucket and on one user whose policy covers that bucket
alone, so no key with more rights ever exists: not the workers', not anyone's. Without this,
any local user could overwrite checkpoints, `latest.json` or a registered model's artifacts,
and so decide which model wins promotion and what the `champion` alias serves.

A local user who sends one of those first requests before `up` does makes one of `up`'s
calls fail (`up` then stops what it started), never gets a share of the stack.
"""

from __future__ import annotations

import json

from infra.services import FAKE_AWS, create_bucket

USER = "ddpflow"
# create_bucket, create_user, put_user_policy, create_access_key: what `create` sends.
BOOTSTRAP_ACTIONS = 4


def bucket_policy(bucket: str) -> dict:
    """Everything on `bucket` and its objects, and listing bucket names (`aws s3 ls`, what a
    person checks first; there is one bucket to see); nothing else."""
    return {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Effect": "Allow",
                "Action": "s3:*",
                "Resource": [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"],
            },
            {"Effect": "Allow", "Action": "s3:ListAllMyBuckets", "Resource": "*"},
        ],
    }


def create(endpoint_url: str, bucket: str, region: str) -> dict[str, str]:
    """The bucket and its user, made with moto's first (unauthenticated) requests; the user's
    key as AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY. Call it right after moto is healthy."""
    import boto3  # late: only `up` pays for the import

    create_bucket(endpoint_url, bucket)
    # Signed with moto's fake keys, which it ignores until the count is spent.
    iam = boto3.client(
        "iam",
        endpoint_url=endpoint_url,
        aws_access_key_id=FAKE_AWS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=FAKE_AWS["AWS_SECRET_ACCESS_KEY"],
        region_name=region,
    )
    iam.create_user(UserName=USER)
    iam.put_user_policy(
        UserName=USER, PolicyName=f"{bucket}-only", PolicyDocument=json.dumps(bucket_policy(bucket))
    )
    key = iam.create_access_key(UserName=USER)["AccessKey"]
    return {
        "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
        "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
    }
