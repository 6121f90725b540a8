"""The ingress's calls to the engine replicas (`RayEngineClient`): what Ray's router
raises becomes the answer Ember gives for the same state in its other modes."""

from __future__ import annotations

from typing import Any

import pytest
from ray.serve._private.common import DeploymentID
from ray.serve.exceptions import DeploymentUnavailableError

from ember.api.errors import as_api_error
from ember.cluster.client import RayEngineClient
from ember.config import load_catalog
from ember.engine import WorkerFailed
from ember.engine.errors import RequestTooLarge
from ember.ipc.models import RemoteModel


class Unavailable:
    """A deployment handle whose every call fails as Ray's router fails it when no engine
    replica runs nor will (the engine application failed to deploy, or was deleted)."""

    def options(self, **_: Any) -> Unavailable:
        return self

    def __getattr__(self, op: str) -> Unavailable:
        return self

    def remote(self, fields: dict[str, Any]) -> Any:
        async def fail() -> None:
            raise DeploymentUnavailableError(DeploymentID("EmberEngine", "ember-engine"))

        return fail()


async def test_no_engine_deployment_is_a_503_to_retry_not_a_500() -> None:
    """Found by a review of the Ray path: Ray's DeploymentUnavailableError fell through to
    a 500 `inference_error`, logged as a fault of the request."""
    client = RayEngineClient(Unavailable())  # type: ignore[arg-type]
    with pytest.raises(WorkerFailed) as caught:
        await client.call("submit", model="ember/synthetic", items=[])
    error = as_api_error(caught.value)
    assert (error.status, error.kind) == (503, "unavailable")
    assert error.headers == {"Retry-After": "1"}
    assert "no engine replica is running" in error.message


def test_one_replicas_full_queue_refuses_nothing_at_the_ingress() -> None:
    """Found by a review of the Ray path: the ingress refused every request for a model
    for 0.5 s after one replica said its queue was full, though another (a new one, after
    a scale-up) had room. Each replica's queue is its own: Ray's router and the replica
    decide."""
    model = RemoteModel(load_catalog()["ember/synthetic"], None,  # type: ignore[arg-type]
                        RayEngineClient(Unavailable()), max_queue_items=10)  # type: ignore[arg-type]
    model.note_pending(10)  # one replica's figure, just now
    model.check_room(1)  # not refused here
    with pytest.raises(RequestTooLarge):  # what no replica could take still is
        model.check_room(11)
