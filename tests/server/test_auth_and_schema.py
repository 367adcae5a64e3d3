"""The API key's check and the OpenAPI document, on the application itself: neither needs an
engine (the app is not started, so the generation routes answer 503 loading once past the
key), so these run in milliseconds."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from dspark.server.app import build_app  # noqa: E402
from dspark.server.config import ServerConfig  # noqa: E402

KEY = "secret"
JSON = {"content-type": "application/json"}


def _client(**config) -> TestClient:
    return TestClient(build_app(ServerConfig(api_key=KEY, **config), None))


def test_the_key_is_checked_before_the_body_is_parsed():
    client = _client()
    response = client.post("/v1/completions", content=b"{not json", headers=JSON)
    assert response.status_code == 401, response.text
    assert response.json()["error"]["code"] == "invalid_api_key"
    authorised = client.post(
        "/v1/completions", content=b"{not json", headers=JSON | {"authorization": f"Bearer {KEY}"}
    )
    assert authorised.status_code == 400


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_the_bearer_scheme_is_case_insensitive(scheme):
    response = _client().post(
        "/v1/completions", json={"prompt": "x"}, headers={"authorization": f"{scheme} {KEY}"}
    )
    assert response.status_code == 503 and response.json()["error"]["code"] == "loading"


@pytest.mark.parametrize(
    "header", [None, "Bearer wrong", f"Basic {KEY}", KEY, f"Bearer  {KEY}x", "Bearer"]
)
def test_a_401_names_the_scheme_in_www_authenticate(header):
    headers = {} if header is None else {"authorization": header}
    response = _client().get("/v1/models", headers=headers)
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == 'Bearer realm="dspark"'
    assert response.json()["error"]["type"] == "authentication_error"


def test_metrics_are_open_unless_the_key_is_required_for_them():
    assert _client().get("/metrics").status_code == 200
    assert _client().get("/health").status_code == 503  # open, not started: loading
    client = _client(require_api_key_for_metrics=True)
    assert client.get("/metrics").status_code == 401
    ok = client.get("/metrics", headers={"authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and "vllm:num_requests_running" in ok.text
    assert client.get("/health").status_code == 503  # still open: probes carry no key


def test_requiring_the_key_for_metrics_needs_a_key():
    with pytest.raises(ValueError, match="require_api_key_for_metrics needs an api_key"):
        ServerConfig(require_api_key_for_metrics=True)


def test_invalid_json_is_a_400_without_a_position_for_a_field():
    response = TestClient(build_app(ServerConfig(), None)).post(
        "/v1/completions", content=b'{"prompt": "x",', headers=JSON
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] is None, error
    assert error["message"].startswith("the request body is not valid JSON"), error


def test_the_openapi_document_tells_the_real_statuses_and_media_types():
    paths = _client().get("/openapi.json").json()["paths"]
    for route in ("/v1/completions", "/v1/chat/completions"):
        responses = paths[route]["post"]["responses"]
        assert "422" not in responses
        assert responses["400"]["content"]["application/json"]
        assert responses["401"]["content"]["application/json"]
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        assert "503" in responses
    assert "422" not in paths["/v1/models"]["get"]["responses"]
