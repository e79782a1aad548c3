"""infra.s3_endpoint: moto's dispatcher, remembering the service of each host name."""

from __future__ import annotations

import pytest
from moto.moto_server.werkzeug_app import DomainDispatcherApplication

from infra.s3_endpoint import RememberingDispatcher


def signed(service: str, path: str) -> dict[str, str]:
    """The WSGI environ of a SigV4-signed request for `service`, as boto3 sends one."""
    credential = f"testing/20261130/us-east-1/{service}/aws4_request"
    return {
        "REQUEST_METHOD": "GET",
        "PATH_INFO": path,
        "QUERY_STRING": "",
        "HTTP_HOST": "127.0.0.1:9000",
        "HTTP_AUTHORIZATION": (
            f"AWS4-HMAC-SHA256 Credential={credential}, SignedHeaders=host, Signature=0"
        ),
    }


def test_each_host_name_is_looked_up_once_and_finds_moto_s_own_answer(monkeypatch):
    looked_up: list[str | None] = []
    lookup = DomainDispatcherApplication.get_backend_for_host

    def counted(self: DomainDispatcherApplication, host: str | None) -> object:
        looked_up.append(host)
        return lookup(self, host)

    monkeypatch.setattr(DomainDispatcherApplication, "get_backend_for_host", counted)
    remembering, moto_s_own = RememberingDispatcher(), DomainDispatcherApplication(lambda _: None)
    for service, path in [("s3", "/bucket/key"), ("iam", "/"), ("s3", "/bucket/other")]:
        request = signed(service, path)
        host = remembering.infer_service_region_host(request, path)
        assert remembering.get_backend_for_host(host) == lookup(moto_s_own, host)
    # The S3 host name was looked up for the first S3 request only; IAM's once too.
    s3_host = "s3.us-east-1.amazonaws.com"
    assert looked_up.count(s3_host) == 1, looked_up
    assert len(looked_up) == 2, looked_up


@pytest.mark.parametrize("service", ["s3", "iam"])
def test_a_request_reaches_the_app_of_its_service(service):
    dispatcher = RememberingDispatcher()
    first = dispatcher.get_application(signed(service, "/bucket/key"))
    assert first is dispatcher.get_application(signed(service, "/bucket/key"))
    assert dispatcher.app_instances == {service: first}
