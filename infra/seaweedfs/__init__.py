"""SeaweedFS, the S3 server of the local stack, the compose recipe and the S3 tests.

`config` writes what a server is told (its S3 identities, its security.toml and the
certificates its inner services use between themselves); `server` starts one on 127.0.0.1
and waits for it; `serve` is the compose recipe's entry point in the project's image.
"""
