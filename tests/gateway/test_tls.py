"""TLS termination: an https:// request with a self-signed certificate authority made in the test."""

from __future__ import annotations

import ssl

import httpx
import openai
import pytest
import trustme

from inferd.gateway.config import AuthConfig
from tests.gateway.conftest import smol
from tests.gateway.upstream import FakeUpstream


@pytest.fixture
def tls_files(tmp_path):  # noqa: ANN201
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    paths = {name: tmp_path / f"{name}.pem" for name in ("ca", "cert", "key")}
    ca.cert_pem.write_to_path(paths["ca"])
    cert.private_key_pem.write_to_path(paths["key"])
    for i, pem in enumerate(cert.cert_chain_pems):
        pem.write_to_path(paths["cert"], append=i > 0)
    return paths


def test_https_with_a_self_signed_certificate(gateway_factory, tls_files):
    fake = FakeUpstream().start()
    try:
        live = gateway_factory(
            [smol([fake.url])], auth=AuthConfig(enabled=False),
            tls_cert=str(tls_files["cert"]), tls_key=str(tls_files["key"]),
        )
        live.wait_ready("smol", 1)
        assert live.url.startswith("https://")
        trusted = ssl.create_default_context(cafile=str(tls_files["ca"]))
        with httpx.Client(base_url=live.url, verify=trusted, timeout=30) as c:
            assert c.get("/health").status_code == 200
            reply = c.post("/v1/completions", json={"prompt": "x"})
            assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "from fake"
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0,
                               http_client=httpx.Client(verify=trusted))
        assert client.completions.create(model="smol", prompt="x").choices[0].text == "from fake"
        client.close()
        # Without the authority the certificate is refused, and plain HTTP gets nowhere.
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{live.url}/health")
        with pytest.raises(httpx.HTTPError):
            httpx.get(live.url.replace("https://", "http://") + "/health", timeout=2)
    finally:
        fake.stop()
