"""A real S3-compatible server for the mirror tests: moto's server mode on 127.0.0.1, the
environment that points s3fs at it, and buckets made in it."""

from __future__ import annotations

import socket
import uuid

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "NO_PROXY": "127.0.0.1",
}
# Fail fast against a dead endpoint: one attempt per call, short connect timeout (the
# uploader's own backoff is what is under test, not botocore's).
FAST_FAIL = {"config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def boto_credentials() -> dict:
    return {
        "aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        "region_name": CREDENTIALS["AWS_DEFAULT_REGION"],
    }


class S3:
    """A moto S3 server on 127.0.0.1 and the environment that points s3fs at it."""

    def __init__(self, port: int = 0):
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.env = {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, **boto_credentials())

    def bucket(self) -> str:
        name = f"m3-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        self.server.stop()
