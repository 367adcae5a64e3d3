"""Schema fuzzing of the running server from its own /openapi.json (schemathesis).

Hypothesis draws requests for every operation the schema declares, both valid bodies (the
declared bounds) and invalid ones (wrong types, values outside the bounds, missing fields);
each goes to the real server over HTTP. Whatever comes in, the answer is never a 5xx, and
every error is in the OpenAI envelope. The run is seeded (derandomized), so a failure repeats.
"""

from __future__ import annotations

from collections import Counter

import pytest

from tests.server.conftest import API_KEY, auth, engine_config, start_server

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402

EXAMPLES_PER_MODE = 300  # per generation mode, over all operations
MIN_CASES_PER_MODE = 250  # hypothesis may stop early once a space is exhausted


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama_dir):
    """A 64-token context keeps each valid case short (max_tokens <= 63), so hundreds run in
    seconds; the server is otherwise the plain test server."""
    live = start_server(engine_config(tiny_llama_dir, max_model_len=64), api_key=API_KEY)
    yield live
    live.stop()


def _check(case, response) -> None:
    where = f"{case.method} {case.path} body={case.body!r:.300}"
    assert response.status_code < 500, f"{where} -> {response.status_code} {response.text[:300]}"
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, (where, error)
        assert isinstance(error["message"], str) and error["message"], (where, error)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_input_makes_the_server_fail(fuzz_server, mode, record_property, capsys):
    server = fuzz_server
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    cases = []

    @settings(max_examples=EXAMPLES_PER_MODE, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=schema.as_strategy(generation_mode=mode))
    def run(case):
        response = case.call(base_url=server.url, headers=auth(), timeout=60)
        cases.append((case.method, case.path, response.status_code))
        _check(case, response)

    run()
    by_status = Counter(f"{method} {path} {status}" for method, path, status in cases)
    record_property("fuzz_cases", len(cases))
    with capsys.disabled():
        print(f"\n[fuzz {mode.value}] {len(cases)} cases: {dict(sorted(by_status.items()))}")
    assert len(cases) >= MIN_CASES_PER_MODE
    if mode == GenerationMode.POSITIVE:  # valid bodies do reach the engine
        assert any(key.endswith(" 200") and "completions" in key for key in by_status)
    server.wait_idle()
    server.assert_pages_free()
