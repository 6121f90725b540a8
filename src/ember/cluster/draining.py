"""The stand-in that takes the ingress's route during a drain on Ray.

Deleting the ingress application removes its route at once, and Ray's proxy then answers
a new request with a plain-text 404, which clients take as final. So the drain first
deploys this stand-in in the ingress's place: new requests get the 503 `unavailable` with
`Retry-After` that the other modes give while draining, and Ray stops the ingress
replicas once they have answered what they took (`ember.cluster.run`).
"""

from __future__ import annotations

from ray import serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ember.api.errors import error_response

DRAINING = "EmberDraining"
RETRY_AFTER_S = 5  # as the other modes' drain says


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})  # the server process lives until the drain ends


async def refuse(request: Request) -> Response:
    return error_response(503, "unavailable", "the server is draining before shutdown; "
                          "retry on another instance",
                          headers={"Retry-After": str(RETRY_AFTER_S)})


ANY_METHOD = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
draining_app = Starlette(routes=[Route("/healthz", healthz),
                                 Route("/{path:path}", refuse, methods=ANY_METHOD)])


@serve.ingress(draining_app)
class EmberDraining:
    """Answers every request but `/healthz` with a 503 until the drain ends."""
