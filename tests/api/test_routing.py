"""The inference dispatcher: routes matched once per path, each request with its own
path parameters, and every other request left to FastAPI."""

from __future__ import annotations

import pytest

from ember.api import routing
from tests.api.conftest import SYNTH, Served, assert_error, encode_body, vectors


async def test_paths_route_the_same_before_and_after_the_match_cache_fills(
        shared: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(routing, "MATCH_CACHE_SIZE", 2)  # cleared every third new path
    for _ in range(2):
        ok = await shared.client.post(f"/v1/encode/{SYNTH}", json=encode_body("a"))
        assert ok.status_code == 200 and len(vectors(ok.json())) == 1
        scored = await shared.client.post(f"/v1/score/{SYNTH}", json={
            "query": {"text": "q"}, "items": [{"text": "a"}, {"text": "b"}]})
        assert scored.status_code == 200 and len(scored.json()["scores"]) == 2
        for missing in ("no/such-model", "another/missing-one"):
            response = await shared.client.post(f"/v1/encode/{missing}",
                                                json=encode_body("a"))
            body = assert_error(response, 404)
            assert missing in body["message"]  # this request's own path parameter
        assert (await shared.client.post("/v1/not-a-route", json={})).status_code == 404
        assert (await shared.client.get(f"/v1/models/{SYNTH}")).status_code == 200
