"""The API contract suite against the Ray deployment: the end-to-end tests of
tests/api/test_server_e2e.py (routes, clients nobody here wrote, errors, headers,
msgpack), each run here with `live_server` being `ember serve --ray` (tests/cluster/
conftest.py).

Left out, with the reason: the metrics tests (the forwards' metrics live in each engine
replica's process; the ingress's /metrics reports the HTTP side: docs/scaling.md), and the
SIGTERM tests, which read those metrics and the one-process log (the drain on Ray has its
own test, tests/cluster/test_autoscale_and_drain.py).
"""

from __future__ import annotations

from tests.api.test_server_e2e import (
    test_errors_and_headers_over_the_wire,
    test_hf_inference_client_feature_extraction,
    test_msgpack_over_the_wire,
    test_native_routes,
    test_openai_sdk_base64_matches_the_native_route,
    test_openai_sdk_float_matches_the_native_route,
    test_ready_health_docs,
)

__all__ = [
    "test_errors_and_headers_over_the_wire",
    "test_hf_inference_client_feature_extraction",
    "test_msgpack_over_the_wire",
    "test_native_routes",
    "test_openai_sdk_base64_matches_the_native_route",
    "test_openai_sdk_float_matches_the_native_route",
    "test_ready_health_docs",
]
