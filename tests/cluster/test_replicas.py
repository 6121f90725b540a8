"""Two engine replicas behind one ingress (`ember serve --ray --replicas 2`): the API
contract suite passes against it, traffic reaches both replicas, two models share the pool
and each request is answered by its own model, a loading model does not hold the others
up, and a replica killed under load loses no request.

The contract suite is the end-to-end tests of tests/api/test_server_e2e.py (routes, clients
nobody here wrote, errors, headers, msgpack), imported below with `live_server` being this
deployment (tests/cluster/conftest.py); they run first. In this file, not one of its own,
so that the suite's two processes do not each start a Ray deployment. Left out, with the
reason: the metrics tests (the forwards' metrics live in each engine replica's process; the
ingress's /metrics reports the HTTP side: docs/scaling.md), and the SIGTERM tests, which
read those metrics and the one-process log (the drain on Ray has its own test,
tests/cluster/test_autoscale_and_drain.py).
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from ember.adapters.synthetic import SyntheticAdapter
from tests.api.conftest import BROKEN, BUSY, SLOW, SYNTH, encode_body, vectors
from tests.api.test_server_e2e import (  # the contract suite, run here first
    test_errors_and_headers_over_the_wire,
    test_hf_inference_client_feature_extraction,
    test_msgpack_over_the_wire,
    test_native_routes,
    test_openai_sdk_base64_matches_the_native_route,
    test_openai_sdk_float_matches_the_native_route,
    test_ready_health_docs,
)
from tests.cluster.conftest import (
    LOADING,
    OVERLOAD,
    actors_titled,
    engine_replicas,
    replicas_of,
    wait_replicas,
)
from tests.live_server import ServerProcess

__all__ = [
    "test_errors_and_headers_over_the_wire",
    "test_hf_inference_client_feature_extraction",
    "test_msgpack_over_the_wire",
    "test_native_routes",
    "test_openai_sdk_base64_matches_the_native_route",
    "test_openai_sdk_float_matches_the_native_route",
    "test_ready_health_docs",
]

SYNTH_DIMS, BUSY_DIMS = 64, 16  # the catalog's ember/synthetic; tests/api's busy model


def encode(server: ServerProcess, client: httpx.Client, model: str, text: str,
           request_id: str | None = None) -> np.ndarray:
    """One text's vector; the request must succeed."""
    headers = {"x-request-id": request_id} if request_id else {}
    response = client.post(f"{server.url}/v1/encode/{model}", json=encode_body(text),
                           headers=headers, timeout=60)
    assert response.status_code == 200, (response.status_code, response.text)
    return np.array(vectors(response.json())[0], dtype=np.float32)


def test_both_replicas_receive_traffic(ray_server: ServerProcess) -> None:
    since = ray_server.log_size()
    ids = {f"spread-{i}" for i in range(48)}
    reference = SyntheticAdapter(dims=BUSY_DIMS)
    with httpx.Client() as client, ThreadPoolExecutor(16) as pool:
        got = dict(zip(ids, pool.map(
            lambda rid: encode(ray_server, client, BUSY, rid, rid), ids), strict=True))
    for rid, vector in got.items():
        np.testing.assert_allclose(vector, reference.vector(rid), atol=1e-6)
    counts = replicas_of(ray_server, ids, since)
    assert counts.total() == len(ids), (counts, ray_server.log_tail())
    assert len(counts) == 2, counts  # both replicas worked
    assert min(counts.values()) >= 4, counts  # and neither only once or twice


def test_two_models_multiplexed_over_one_pool(ray_server: ServerProcess) -> None:
    """Interleaved requests for two models over the same replicas: each answer has its own
    model's dimensions and vector (the models' vectors differ for the same text)."""
    models = {SYNTH: SyntheticAdapter(dims=SYNTH_DIMS), BUSY: SyntheticAdapter(dims=BUSY_DIMS)}
    calls = [(model, f"multiplexed {i}") for i, model in
             zip(range(60), itertools.cycle(models), strict=False)]
    with httpx.Client() as client, ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda call: encode(ray_server, client, *call), calls))
    for (model, text), vector in zip(calls, answers, strict=True):
        assert vector.shape == (models[model].dims,), (model, vector.shape)
        np.testing.assert_allclose(vector, models[model].vector(text), atol=1e-6)
    listed = {m["id"]: m for m in httpx.get(f"{ray_server.url}/v1/models").json()["data"]}
    assert listed[SYNTH]["dims"] == SYNTH_DIMS


def test_a_loading_model_does_not_block_the_others(ray_server: ServerProcess) -> None:
    """While a model loads (its weights, and torch if not yet imported), requests for a
    loaded model keep being answered."""
    reference = SyntheticAdapter(dims=SYNTH_DIMS)
    with httpx.Client() as client, ThreadPoolExecutor(1) as pool:
        loading = pool.submit(client.post, f"{ray_server.url}/v1/encode/{LOADING}",
                              json=encode_body("a model that loads slowly"), timeout=120)
        answered_during_load = 0
        while not loading.done():
            text = f"during the load {answered_during_load}"
            np.testing.assert_allclose(encode(ray_server, client, SYNTH, text),
                                       reference.vector(text), atol=1e-6)
            if not loading.done():
                answered_during_load += 1
        response = loading.result()
    assert response.status_code == 200, response.text
    assert len(vectors(response.json())[0]) == 384
    # Requests of ~10-40 ms kept going all along the load (0.4-0.6 s here, torch being
    # imported in the replica by then: 12 answered in one of 0.58 s).
    assert answered_during_load >= 3, answered_during_load


def test_a_model_one_replica_loaded_is_listed_loaded_whichever_replica_is_asked(
        ray_server: ServerProcess) -> None:
    """A model loaded on first use sits on one replica of two, and each status call goes to
    either: `/v1/models` said loaded or available by which one Ray asked. The ingress
    merges what each replica said."""
    with httpx.Client(timeout=120) as client:
        answer = client.post(f"{ray_server.url}/v1/encode/{LOADING}",
                             json=encode_body("loaded on one replica"))
        assert answer.status_code == 200, answer.text
        states = [next(m["state"] for m in client.get(f"{ray_server.url}/v1/models")
                       .json()["data"] if m["id"] == LOADING) for _ in range(16)]
    assert states == ["loaded"] * 16, states


def test_a_replica_killed_under_load_loses_no_request(ray_server: ServerProcess) -> None:
    """16 clients keep 50 ms forwards busy on both replicas; one replica is killed (SIGKILL)
    mid-way. Every request gets its own correct vector: those the dead replica was running
    are sent once more by the ingress, those routed to it go to the other replica, and
    Serve starts a replacement."""
    reference = SyntheticAdapter(dims=BUSY_DIMS)
    since = ray_server.log_size()
    texts = [f"under fire {i}" for i in range(240)]
    done: list[int] = []

    def one(text: str) -> np.ndarray:
        with httpx.Client() as client:
            vector = encode(ray_server, client, BUSY, text)
        done.append(1)
        return vector

    victims = engine_replicas(ray_server)
    assert len(victims) == 2
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(one, text) for text in texts]
        deadline = time.monotonic() + 60
        while len(done) < 40:  # well under way: both replicas hold requests now
            assert time.monotonic() < deadline, ray_server.log_tail()
            time.sleep(0.01)
        os.kill(victims[0].pid, signal.SIGKILL)
        answers = [future.result() for future in futures]  # any failure raises here
    for text, vector in zip(texts, answers, strict=True):
        np.testing.assert_allclose(vector, reference.vector(text), atol=1e-6)
    # The death was met on the request path: calls it was running were sent again by the
    # ingress, or calls bound for it were routed elsewhere by Ray's router (which says so).
    # Which of the two depends on the moment of the kill; the lines reach the log late.
    noticed = ("an engine replica died before answering submit",
               "will not be considered for future requests because it has died")
    deadline = time.monotonic() + 20
    while not any(line in ray_server.log_text(since) for line in noticed):
        assert time.monotonic() < deadline, ray_server.log_text(since)[-4000:]
        time.sleep(0.2)
    wait_replicas(ray_server, 2, 90)  # Serve replaced it
    with httpx.Client() as client:
        np.testing.assert_allclose(encode(ray_server, client, BUSY, "after"),
                                   reference.vector("after"), atol=1e-6)


def answered(log: str, request_id: str, status: int) -> bool:
    """Whether the log holds the access line of `request_id` with `status`."""
    return any(f" {status} " in line and f"request_id={request_id} " in line
               for line in log.splitlines())


def test_a_client_that_goes_away_cancels_its_call_on_the_engine_replica(
        ray_server: ServerProcess) -> None:
    """While a 300 ms forward runs and another request waits, a third client gives up:
    Ray cancels its call on the engine replica (Serve's access line says CANCELLED),
    which drops its queued item there (R9), and the ingress answers 499 to nobody."""
    url = f"{ray_server.url}/v1/encode/{SLOW}"
    with httpx.Client() as client:  # loaded first: the load is not what is abandoned
        assert client.post(url, json=encode_body("warm"), timeout=60).status_code == 200
    for attempt in range(3):  # a busy ingress may take the 200 ms before it calls the engine
        since, request_id = ray_server.log_size(), f"gone-away-{attempt}"
        with ThreadPoolExecutor(2) as pool:
            busy = [pool.submit(httpx.post, url, json=encode_body(f"busy {i}"), timeout=60)
                    for i in range(2)]
            time.sleep(0.1)
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(url, json=encode_body("abandoned"), timeout=0.2,
                           headers={"x-request-id": request_id})
            assert [f.result().status_code for f in busy] == [200, 200]
        deadline = time.monotonic() + 20
        while not (seen := answered(text := ray_server.log_text(since), request_id, 499)):
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if not seen:  # Ray cancelled it before the ingress's routes saw it (a busy host)
            assert f"request_id={request_id} " not in text, text[-4000:]  # nor answered it
            continue
        while f"{request_id} -- CALL / CANCELLED" not in (text := ray_server.log_text(since)):
            assert f"{request_id} -- CALL / OK" not in text, text[-4000:]  # it ran: not dropped
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        else:
            return
        assert f"{request_id} -- CALL /" not in text, text[-4000:]  # called, never cancelled
    pytest.fail("in 3 tries the abandoned call never reached the engine replica (or the "
                "ingress's routes) before its client left")


def test_a_call_whose_replica_dies_mid_forward_is_sent_once_more(
        ray_server: ServerProcess) -> None:
    """A request is in its 300 ms forward when every engine replica is killed (SIGKILL):
    its call fails on the dead replica, the ingress sends it once more, the call waits for
    Serve's replacements, and the client gets its own correct answer."""
    reference = SyntheticAdapter(dims=16)  # tests/api's slow model
    url = f"{ray_server.url}/v1/encode/{SLOW}"
    resent = "an engine replica died before answering submit"
    since = ray_server.log_size()
    for attempt in range(3):  # on a loaded machine the kill may land after the forward
        wait_replicas(ray_server, 2, 90)  # every replica is up, so the kill meets each
        with httpx.Client() as client:  # loaded first, so the kill meets the forward
            assert client.post(url, json=encode_body("warm"), timeout=60).status_code == 200
        victims = engine_replicas(ray_server)
        with ThreadPoolExecutor(1) as pool:
            text = f"mid-forward {attempt}"
            answer = pool.submit(httpx.post, url, json=encode_body(text), timeout=120)
            time.sleep(0.15)  # inside the forward
            for victim in victims:
                os.kill(victim.pid, signal.SIGKILL)
            response = answer.result()
        assert response.status_code == 200, response.text
        np.testing.assert_allclose(vectors(response.json())[0], reference.vector(text),
                                   atol=1e-6)
        deadline = time.monotonic() + 20
        while resent not in ray_server.log_text(since) and time.monotonic() < deadline:
            time.sleep(0.2)
        if resent in ray_server.log_text(since):
            break
    assert resent in ray_server.log_text(since), ray_server.log_text(since)[-4000:]
    wait_replicas(ray_server, 2, 90)  # the next tests find the pool whole again


def test_overload_is_refused_with_429_not_queued_without_bound(
        ray_server: ServerProcess) -> None:
    """1,350 one-text requests in flight against two replicas of 64 each, which serve 10 a
    second (so that the burst overloads them on any host: with the catalog's synthetic
    model a swamped host's HTTP path delivered no faster than they served): what is over
    the replicas' caps and the router's bounded queue gets 429 with Retry-After at once;
    the rest is served; nothing else happens, and no answer waits without bound. The
    operations routes, 150 requests among them, answer 200 all along (a review found that
    their status call could meet the full router queue, a scrape then getting 429 and
    /readyz a 503 saying the engine was silent; and /readyz answered 503 when its status
    call waited in the router while requests were answered)."""
    import asyncio

    import aiohttp

    in_flight = 1500
    statuses: Counter[str] = Counter()
    latencies: list[float] = []
    retry_after: set[str] = set()
    operations: Counter[str] = Counter()
    refusals: set[str] = set()
    # /readyz too: its status call can wait in Ray's router past its 1 s bound, where it
    # answered 503 "the engine did not answer" while the engine answered requests.
    watched = ("/v1/models", "/metrics", "/info", "/readyz")

    async def one(session: aiohttp.ClientSession, index: int) -> None:
        if index % 10 == 5:  # one in ten, all along the burst, whenever the queue is full
            path = watched[index // 10 % len(watched)]
            async with session.get(f"{ray_server.url}{path}") as reply:
                body = await reply.read()
                operations[f"{path} {reply.status}"] += 1
                if reply.status != 200:  # why, for the failure's message
                    refusals.add(body.decode(errors="replace")[:200])
            return
        started = time.monotonic()
        try:
            async with session.post(f"{ray_server.url}/v1/encode/{OVERLOAD}",
                                    json={"items": [{"text": f"overload {index}"}]}) as reply:
                await reply.read()
                statuses[str(reply.status)] += 1
                if reply.status == 429:
                    retry_after.add(reply.headers.get("Retry-After", ""))
        except aiohttp.ClientError as exc:
            statuses[type(exc).__name__] += 1
        latencies.append(time.monotonic() - started)

    async def run() -> None:
        connector = aiohttp.TCPConnector(limit=in_flight)
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            await asyncio.gather(*(one(session, i) for i in range(in_flight)))

    asyncio.run(run())
    assert set(statuses) <= {"200", "429"}, statuses
    assert set(operations) == {f"{path} 200" for path in watched}, (operations, refusals)
    assert statuses["429"] > 0 and statuses["200"] > 0, statuses
    assert retry_after and "" not in retry_after, retry_after
    p99 = sorted(latencies)[int(0.99 * len(latencies))]
    # Measured here (2 cores): with the catalog's synthetic model and caps of 512, alone p99
    # 20-27 s (Ray's proxy path ~150 requests/s), beside the suite's other process 46-69 s,
    # and in CI some bodies reached the ingress over 30 s late (reliability bug 21); with a
    # core taken by another process, no request was refused at all. With OVERLOAD, caps of
    # 128 and 2,700 sent: alone p99 27 s, with a core taken 48-69 s. Caps of 64 and 1,350
    # sent: alone p99 24 s (1,115 refused), with a core taken 30 s (1,136). The 429s above
    # are the refusal; this bound, under the client's 120 s timeout, only says each came.
    assert p99 < 100, f"p99 {p99:.1f} s: overload queued instead of being refused ({statuses})"


def test_a_model_that_fails_to_load_says_why_and_the_others_serve(
        ray_server: ServerProcess) -> None:
    """On an engine replica as in one process: a 502 naming the model and the cause, and
    every other model keeps serving."""
    url = ray_server.url
    failed = httpx.post(f"{url}/v1/encode/{BROKEN}", json=encode_body("x"), timeout=60)
    assert failed.status_code == 502, failed.text
    error = failed.json()["error"]
    assert error["type"] == "model_load_failed" and error["param"] == "model"
    assert BROKEN in error["message"] and "failed to load: " in error["message"]
    ok = httpx.post(f"{url}/v1/encode/{SYNTH}", json=encode_body("still serving"), timeout=60)
    assert ok.status_code == 200, ok.text


INGRESS_TITLE = "ray::ServeReplica:ember:EmberIngress"


def test_a_killed_ingress_replica_is_replaced_and_the_server_serves_on(
        ray_server: ServerProcess) -> None:
    """The Ray counterpart of an API process's death: the requests that ingress replica
    held may fail with it (their connections went through it); Serve starts another, and
    every request after that is served."""
    def ingresses() -> list[int]:
        return [process.pid for process in actors_titled(ray_server, INGRESS_TITLE)]

    deadline = time.monotonic() + 60
    while len(found := ingresses()) != 1:  # one may still be starting on a loaded machine
        assert time.monotonic() < deadline, (found, ray_server.log_tail())
        time.sleep(0.2)
    [victim] = found
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 90
    while not [pid for pid in ingresses() if pid != victim]:
        assert time.monotonic() < deadline, ray_server.log_tail()
        time.sleep(0.2)
    served = 0
    deadline = time.monotonic() + 60
    with httpx.Client(timeout=30) as client:
        while served < 10:  # the proxy may still route to the dead one for a moment
            assert time.monotonic() < deadline, ray_server.log_tail()
            try:
                ok = client.post(f"{ray_server.url}/v1/encode/{SYNTH}",
                                 json=encode_body(f"after {served}")).status_code == 200
            except httpx.TransportError:
                ok = False
            served = served + 1 if ok else 0
            if not ok:
                time.sleep(0.2)
