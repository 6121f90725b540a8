"""Faults against a real `ember serve` process: SIGTERM under load, a forward that raises,
a client that disconnects while queued, a model that fails to load, a request deadline,
and with `--workers 2` an engine process or an API process killed under load.

The models are synthetic TEST models (not real ones) with a modelled forward time, so
every timing here is set by the test, not by the machine.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import pytest

from tests.live_server import children_titled
from tests.reliability.support import (
    SYNTH,
    Record,
    ServerPool,
    ServerProcess,
    assert_error,
    dense,
    encode_body,
    metric,
    references,
    scrape,
    synthetic_model,
    wait_until,
)

FAULT = "test/fault"  # 100 ms forwards of up to 4 items
SLOW = "test/slow"  # 800 ms forwards of one item
BROKEN = "test/broken"  # a transformer whose weights directory does not exist
EMPTY = "test/empty-dir"  # a transformer whose directory holds no model
SECRET = "secret-weights-8d1f"  # a path component that must never reach a client


def close(vector: list[float], ref: np.ndarray) -> bool:
    return float(np.max(np.abs(np.asarray(vector) - ref))) <= 1e-6


@pytest.fixture(scope="module")
def fault_server(module_servers: ServerPool, tmp_path_factory: pytest.TempPathFactory
                 ) -> ServerProcess:
    empty = tmp_path_factory.mktemp("empty-model")
    missing = tmp_path_factory.mktemp("missing") / SECRET / "minilm"
    missing.mkdir(parents=True)  # a missing folder is refused at start: it goes after
    models = {
        "fault.yaml": synthetic_model(FAULT, overhead_ms=100, max_batch_items=4),
        "slow.yaml": synthetic_model(SLOW, overhead_ms=800, max_batch_items=1),
        "broken.yaml": {"name": BROKEN, "adapter": "transformer", "tasks": ["encode"],
                        "source": {"path": str(missing)}},
        "empty.yaml": {"name": EMPTY, "adapter": "transformer", "tasks": ["encode"],
                       "source": {"path": str(empty)}},
    }
    server = module_servers.start("--default-model", SYNTH, models=models, name="faults")
    missing.rmdir()
    server.notes["tmp_roots"] = [str(empty), str(missing.parent)]
    return server


def metrics_of(server: ServerProcess) -> str:
    with httpx.Client() as client:
        return scrape(client, server.url)


def running(server: ServerProcess, model: str) -> float:
    """The items in `model`'s forward now."""
    return metric(metrics_of(server), "ember_running_items", model=model)


# -- SIGTERM under load ------------------------------------------------------------------


@dataclass
class DrainTally:
    answered: Counter[str] = field(default_factory=Counter)  # outcome -> count
    wrong: int = 0
    accepted: int = 0
    delivered: int = 0
    errors_before_signal: list[str] = field(default_factory=list)
    not_503_after_signal: list[str] = field(default_factory=list)
    answered_during_drain: int = 0  # sent before SIGTERM, answered after it


async def test_sigterm_under_load_loses_nothing(servers: ServerPool, figures: Record) -> None:
    model = "test/drain"
    server = servers.start(
        "--default-model", model,
        models={"drain.yaml": synthetic_model(model, overhead_ms=150, max_batch_items=4)},
        name="sigterm")
    texts = [f"drain text {i}" for i in range(8)]
    refs = references(server.url, model, texts)
    clients = 24
    tally = DrainTally()
    signalled: list[float] = []  # when SIGTERM was sent
    probes: Counter[str] = Counter()
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client:

        async def load(index: int) -> None:
            """A closed-loop client; it stops at its first 503 or refused connection."""
            n = 0
            while True:
                batch = [texts[(index + n) % len(texts)], texts[(index * 3 + n) % len(texts)]]
                batch = batch[: 1 + (index + n) % 2]
                n += 1
                sent = time.monotonic()
                try:
                    response = await client.post(f"/v1/encode/{model}",
                                                 json=encode_body(*batch))
                except httpx.TransportError as exc:
                    outcome = f"connection: {type(exc).__name__}"
                    tally.answered[outcome] += 1
                    if not signalled:
                        tally.errors_before_signal.append(outcome)
                    return
                received = time.monotonic()
                if response.status_code == 503:
                    assert_error(response, 503, "unavailable")
                    tally.answered["503"] += 1
                    if not signalled:
                        tally.errors_before_signal.append("503 before SIGTERM")
                    return
                tally.accepted += 1  # a response other than 503: the server took it
                tally.answered[str(response.status_code)] += 1
                if signalled and sent > signalled[0] + 0.05:
                    tally.not_503_after_signal.append(str(response.status_code))
                got = dense(response.json()) if response.status_code == 200 else []
                if len(got) == len(batch) and all(
                        close(v, refs[t]) for v, t in zip(got, batch, strict=True)):
                    tally.delivered += 1
                    if signalled and received > signalled[0]:
                        tally.answered_during_drain += 1
                else:
                    tally.wrong += 1

        async def probe() -> None:
            """New connections during the drain: encode and /readyz must answer 503."""
            await asyncio.sleep(0.05)
            fresh = httpx.Limits(max_keepalive_connections=0)
            async with httpx.AsyncClient(base_url=server.url, timeout=10, limits=fresh) as p:
                while server.alive():
                    for route in ("encode", "readyz"):
                        try:
                            if route == "encode":
                                response = await p.post(f"/v1/encode/{model}",
                                                        json=encode_body("probe"))
                            else:
                                response = await p.get("/readyz")
                            probes[f"{route} {response.status_code}"] += 1
                        except httpx.TransportError as exc:
                            probes[f"{route} connection: {type(exc).__name__}"] += 1
                    await asyncio.sleep(0.02)

        tasks = [asyncio.create_task(load(i)) for i in range(clients)]
        await asyncio.sleep(1.0)
        with httpx.Client() as sync:
            before = scrape(sync, server.url)
        queued = metric(before, "ember_pending_items", model=model)
        server.terminate()
        signalled.append(time.monotonic())
        prober = asyncio.create_task(probe())
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
        code = await asyncio.to_thread(server.wait, 60)
        exited = time.monotonic()
        await asyncio.wait_for(prober, 10)

    log = server.log_text()
    drained = re.search(r"drained in ([\d.]+) s", log)
    # One line per API process with --workers (one of them may hold none): their sum.
    held = [int(n) for n in re.findall(r"draining, (\d+) requests? in flight", log)]
    data: dict[str, Any] = {
        "model": f"{model} (synthetic test model, 150 ms forwards of up to 4 items)",
        "clients": clients, "queued_items_at_sigterm": int(queued),
        "server_in_flight_at_sigterm": sum(held) if held else None,
        "accepted": tally.accepted, "delivered": tally.delivered, "wrong": tally.wrong,
        "answered_during_drain": tally.answered_during_drain,
        "outcomes": dict(sorted(tally.answered.items())),
        "probes_during_drain": dict(sorted(probes.items())),
        "exit_code": code,
        "drain_s_server_log": float(drained.group(1)) if drained else None,
        "sigterm_to_exit_s": round(exited - signalled[0], 2),
    }
    figures("fault_sigterm", data)
    assert code == 0, log[-3000:]
    assert tally.errors_before_signal == [], tally.errors_before_signal
    assert tally.wrong == 0
    assert tally.accepted == tally.delivered, data  # nothing accepted was lost
    assert tally.answered_during_drain > 0, data  # the drain finished work in flight
    assert sum(held) > 0, data
    assert tally.not_503_after_signal == [], data  # new requests during the drain: 503
    assert probes["encode 503"] > 0 and probes["readyz 503"] > 0, probes
    assert not any(k.endswith((" 200", " 500")) for k in probes), probes
    assert drained is not None and "Traceback" not in log, log[-3000:]


# -- a forward that raises ---------------------------------------------------------------


async def test_forward_fault_fails_only_its_batch(fault_server: ServerProcess,
                                                  figures: Record) -> None:
    url = fault_server.url
    good = [f"good {i}" for i in range(7)]
    refs = references(url, FAULT, ["blocker", *good])
    before = metrics_of(fault_server)
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        blocker = asyncio.create_task(client.post(f"/v1/encode/{FAULT}",
                                                  json=encode_body("blocker")))
        # The blocker's forward runs and the rest queue behind it (or, on a machine that
        # held this test up, it is over and they share forwards: the checks below hold).
        await asyncio.to_thread(wait_until, lambda: blocker.done() or running(
            fault_server, FAULT) >= 1, 10, "the blocker's forward")
        texts = [*good, "__fail__ injected"]
        answers = await asyncio.gather(*(client.post(f"/v1/encode/{FAULT}",
                                                     json=encode_body(t)) for t in texts))
        first = await blocker
        after_fault = await client.post(f"/v1/encode/{FAULT}", json=encode_body(good[0]))
    after = metrics_of(fault_server)
    failures = (metric(after, "ember_forward_failures_total", model=FAULT)
                - metric(before, "ember_forward_failures_total", model=FAULT))
    failed = [(t, r) for t, r in zip(texts, answers, strict=True) if r.status_code != 200]
    served = [(t, r) for t, r in zip(texts, answers, strict=True) if r.status_code == 200]
    messages = []
    for _, response in failed:
        error = assert_error(response, 500, "inference_error")
        messages.append(error["message"])
        assert "SyntheticFault" in error["message"] and "__fail__" in error["message"], error
    for text, response in served:
        assert close(dense(response.json())[0], refs[text])
    assert first.status_code == 200 and close(dense(first.json())[0], refs["blocker"])
    assert after_fault.status_code == 200 and close(dense(after_fault.json())[0], refs[good[0]])
    figures("fault_forward_raises", {
        "model": f"{FAULT} (synthetic test model, 100 ms forwards of up to 4 items)",
        "queued_requests": len(texts), "forward_failures": int(failures),
        "failed_requests": len(failed), "served_requests": len(served),
        "error_message": messages[0] if messages else None,
        "next_request_status": after_fault.status_code})
    assert int(failures) == 1
    assert "__fail__ injected" in [t for t, _ in failed]
    assert 1 <= len(failed) <= 4, "only the requests of the failed forward fail"
    assert len(served) == len(texts) - len(failed) >= 4


# -- a client that disconnects while queued -------------------------------------------------


async def raw_post(port: int, path: str, body: dict[str, Any]
                   ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A request on a raw connection the test can close at any moment."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = json.dumps(body).encode()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                 f"\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
    await writer.drain()
    return reader, writer


async def test_client_disconnect_while_queued_drops_its_items(fault_server: ServerProcess,
                                                              figures: Record) -> None:
    url = fault_server.url
    refs = references(url, SLOW, ["first", "third"])
    before = metrics_of(fault_server)
    log_from = fault_server.log_size()
    with httpx.Client() as sync:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            first = asyncio.create_task(client.post(f"/v1/encode/{SLOW}",
                                                    json=encode_body("first")))
            await asyncio.to_thread(wait_until, lambda: running(fault_server, SLOW) >= 1, 10,
                                    "the first request's 800 ms forward")
            _, writer = await raw_post(fault_server.port, f"/v1/encode/{SLOW}",
                                       encode_body("goes away"))
            await asyncio.sleep(0.02)
            third = asyncio.create_task(client.post(f"/v1/encode/{SLOW}",
                                                    json=encode_body("third")))
            await asyncio.to_thread(
                wait_until, lambda: metric(scrape(sync, url), "ember_pending_items",
                                           model=SLOW) == 2, 0.7, "two requests queued")
            writer.close()  # while queued behind the running forward
            await writer.wait_closed()
            answers = [await first, await third]
        after = scrape(sync, url)
        healthy = sync.get(f"{url}/healthz").status_code
        again = sync.post(f"{url}/v1/encode/{SLOW}", json=encode_body("third"), timeout=30)

    def delta(name: str, **labels: str) -> int:
        return int(metric(after, name, **labels) - metric(before, name, **labels))

    dropped = delta("ember_dropped_items_total", model=SLOW)
    forwards = delta("ember_batch_items_count", model=SLOW)
    gone = delta("ember_requests_total", route="/v1/encode/{model:path}", model=SLOW, status="499")
    figures("fault_client_disconnect", {
        "model": f"{SLOW} (synthetic test model, 800 ms forwards of one item)",
        "requests": 3, "disconnected_while_queued": 1, "dropped_items": dropped,
        "forwards": forwards, "status_499_counted": gone,
        "others": [r.status_code for r in answers], "healthz_after": healthy,
        "next_request_status": again.status_code})
    assert [r.status_code for r in answers] == [200, 200]
    assert close(dense(answers[0].json())[0], refs["first"])
    assert close(dense(answers[1].json())[0], refs["third"])
    assert dropped == 1, "the disconnected request's item was dropped before a forward"
    assert forwards == 2, "its item never reached a forward"
    assert gone == 1
    assert healthy == 200 and again.status_code == 200
    assert "Traceback" not in fault_server.log_text(log_from)


# -- a model that fails to load --------------------------------------------------------------


def test_model_that_fails_to_load_says_why_and_others_serve(fault_server: ServerProcess,
                                                            figures: Record) -> None:
    url = fault_server.url
    leaks = [SECRET, *fault_server.notes["tmp_roots"], "/tmp/"]
    found: dict[str, Any] = {}
    with httpx.Client(base_url=url, timeout=60) as client:
        for name, cause in ((BROKEN, "does not exist"), (EMPTY, "")):
            for route, body in ((f"/v1/encode/{name}", encode_body("hello")),
                                ("/v1/embeddings", {"model": name, "input": "hello"}),
                                (f"/v1/encode/{name}", encode_body("again"))):
                response = client.post(route, json=body)
                error = assert_error(response, 502, "model_load_failed", "model", leaks)
                assert name in error["message"] and "failed to load" in error["message"]
                assert cause in error["message"], error
                found[name] = error["message"]
        ok = client.post(f"/v1/encode/{SYNTH}", json=encode_body("hello"))
        assert ok.status_code == 200 and len(dense(ok.json())[0]) == 64
        ok_fault_model = client.post(f"/v1/encode/{FAULT}", json=encode_body("hello"))
        assert ok_fault_model.status_code == 200
        assert client.get("/readyz").status_code == 200
        states = {m["id"]: m["state"] for m in client.get("/v1/models").json()["data"]}
    assert states[BROKEN] == "failed" and states[EMPTY] == "failed", states
    figures("fault_model_load", {"errors": found, "other_models_status": ok.status_code,
                                 "states": {BROKEN: states[BROKEN], EMPTY: states[EMPTY]}})


# -- a slow forward under a request deadline ------------------------------------------------


async def test_request_timeout_is_a_clear_504_and_drops_queued_work(servers: ServerPool,
                                                                    figures: Record) -> None:
    model = "test/words"  # 20 ms a word: 75 words take 1.5 s, one word 20 ms
    server = servers.start(
        "--default-model", SYNTH, "--request-timeout-s", "0.5",
        models={"words.yaml": synthetic_model(model, overhead_ms=0, per_token_us=20_000,
                                              max_batch_items=1)},
        name="timeout")
    long_text = " ".join(["word"] * 75)
    before = metrics_of(server)
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:

        async def timed(text: str) -> tuple[httpx.Response, float]:
            sent = time.monotonic()
            response = await client.post(f"/v1/encode/{model}", json=encode_body(text))
            return response, time.monotonic() - sent

        running = asyncio.create_task(timed(long_text))
        await asyncio.sleep(0.05)
        queued = asyncio.create_task(timed(long_text + " queued"))
        (first, first_s), (second, second_s) = await running, await queued
        # The first forward (1.5 s) could not be stopped; the queued item never starts.
        await asyncio.to_thread(
            wait_until, lambda: metric(metrics_of(server), "ember_batch_items_count",
                                       model=model) >= 1, 5, "the running forward ends")
        short, short_s = await timed("short")
    after = metrics_of(server)

    def delta(name: str, **labels: str) -> int:
        return int(metric(after, name, **labels) - metric(before, name, **labels))

    errors = [assert_error(r, 504, "timeout") for r in (first, second)]
    figures("fault_request_timeout", {
        "model": f"{model} (synthetic test model, 20 ms a word, one item a forward)",
        "request_timeout_s": 0.5, "running_request": {"status": first.status_code,
                                                      "seconds": round(first_s, 2)},
        "queued_request": {"status": second.status_code, "seconds": round(second_s, 2)},
        "dropped_items": delta("ember_dropped_items_total", model=model),
        "forwards": delta("ember_batch_items_count", model=model),
        "short_request": {"status": short.status_code, "seconds": round(short_s, 3)},
        "message": errors[0]["message"]})
    for error in errors:  # the limit and the flag that sets it, named
        assert "request timeout of 0.5 s (--request-timeout-s)" in error["message"], error
    assert first_s < 1.3 and second_s < 1.3, "the deadline ended the requests, not the model"
    assert short.status_code == 200 and short_s < 0.5
    assert delta("ember_dropped_items_total", model=model) == 1, "the queued item was dropped"
    assert delta("ember_batch_items_count", model=model) == 2, "only started work ran"
    assert delta("ember_rejections_total", reason="timeout") == 2
    with httpx.Client() as sync:
        assert sync.get(f"{server.url}/healthz").status_code == 200


# -- a process of `--workers N` dies --------------------------------------------------------

CRASH = "test/crash"  # 50 ms forwards of up to 8 items, served by two API processes




@dataclass
class LoadTally:
    """Closed-loop clients, one keep-alive connection each: what each request got."""

    outcomes: Counter[str] = field(default_factory=Counter)
    failures: list[tuple[int | None, str]] = field(default_factory=list)  # (client port, what)
    after_kill: int = 0  # answered 200 after the kill
    connected: set[int] = field(default_factory=set)  # clients whose connection has a port


def client_port(response: httpx.Response) -> int | None:
    """The local port of the connection that carried `response`, while it is open."""
    stream = response.extensions.get("network_stream")
    try:
        return int(stream.get_extra_info("client_addr")[1]) if stream is not None else None
    except OSError:  # closed by now: the next request opens another
        return None


async def closed_loop(url: str, model: str, clients: int, tally: LoadTally,
                      stop: asyncio.Event, killed: list[float]) -> None:
    async def one(index: int) -> None:
        port: int | None = None  # the local port of this client's connection
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            n = 0
            while not stop.is_set():
                n += 1
                text = f"client {index} request {n}"
                try:
                    response = await client.post(f"/v1/encode/{model}",
                                                 json=encode_body(text))
                except httpx.TransportError as exc:
                    tally.outcomes[type(exc).__name__] += 1
                    tally.failures.append((port, type(exc).__name__))
                    port = None
                    continue
                port = client_port(response)
                if port is not None:
                    tally.connected.add(index)
                tally.outcomes[str(response.status_code)] += 1
                if response.status_code != 200 or len(dense(response.json())) != 1:
                    tally.failures.append((port, f"{response.status_code} "
                                                 f"{response.text[:200]}"))
                elif killed:
                    tally.after_kill += 1

    await asyncio.gather(*(one(i) for i in range(clients)))


@pytest.mark.own_mode  # chooses its own --workers: not run again by the mode rerun
async def test_engine_killed_under_load_loses_no_request(servers: ServerPool,
                                                         figures: Record) -> None:
    server = servers.start("--default-model", CRASH, "--workers", "2", models={
        "crash.yaml": synthetic_model(CRASH, overhead_ms=50, max_batch_items=8)},
        name="engine-kill")
    tally, stop, killed = LoadTally(), asyncio.Event(), []
    load = asyncio.create_task(closed_loop(server.url, CRASH, 32, tally, stop, killed))
    await asyncio.sleep(1.5)
    [engine] = children_titled(server, "ember: engine")
    engine.kill()
    killed.append(time.monotonic())

    def replaced() -> bool:
        return any(p.pid != engine.pid for p in children_titled(server, "ember: engine"))

    await asyncio.to_thread(wait_until, replaced, 60, "a new engine process")
    await asyncio.to_thread(wait_until, lambda: tally.after_kill >= 100, 60,
                            "100 answers after the kill")
    stop.set()
    await asyncio.wait_for(load, 60)
    log = server.log_text()
    figures("fault_engine_killed", {
        "model": f"{CRASH} (synthetic test model, 50 ms forwards of up to 8 items)",
        "workers": 2, "clients": 32, "outcomes": dict(tally.outcomes),
        "answered_after_kill": tally.after_kill,
        "resent_lines": len(re.findall(r"a new engine process answers", log))})
    assert tally.failures == [], tally.failures[:10]
    assert server.alive()
    assert "a new engine process serves" in log, log[-3000:]
    assert re.search(r"a new engine process answers; sending it the \d+ requests", log)


@pytest.mark.own_mode  # chooses its own --workers: not run again by the mode rerun
async def test_api_process_killed_under_load_fails_only_its_own_requests(
        servers: ServerPool, figures: Record) -> None:
    server = servers.start("--default-model", CRASH, "--workers", "2", models={
        "crash.yaml": synthetic_model(CRASH, overhead_ms=50, max_batch_items=8)},
        name="api-kill")
    tally, stop, killed = LoadTally(), asyncio.Event(), []
    load = asyncio.create_task(closed_loop(server.url, CRASH, 32, tally, stop, killed))
    await asyncio.to_thread(wait_until, lambda: len(tally.connected) == 32, 60,
                            "every client connected")
    await asyncio.sleep(0.5)
    held = {api: {c.raddr.port for c in api.net_connections("tcp")
                  if c.raddr and c.laddr.port == server.port}  # its client connections
            for api in children_titled(server, "ember: api")}
    victim = max(held, key=lambda api: len(held[api]))  # the one with the most clients
    own = held[victim]
    victim.kill()
    killed.append(time.monotonic())
    await asyncio.to_thread(wait_until, lambda: tally.after_kill >= 100, 60,
                            "100 answers after the kill")
    stop.set()
    await asyncio.wait_for(load, 60)
    others = [(port, what) for port, what in tally.failures if port not in own]
    figures("fault_api_process_killed", {
        "model": f"{CRASH} (synthetic test model, 50 ms forwards of up to 8 items)",
        "workers": 2, "clients": 32, "victim_connections": len(own),
        "outcomes": dict(tally.outcomes), "failed_on_victim": len(tally.failures) - len(others),
        "failed_elsewhere": others})
    assert own, "the victim held no client connection"
    assert others == [], others
    assert all(what in {"ReadError", "RemoteProtocolError", "ConnectError"}
               for _, what in tally.failures), tally.failures
    assert server.alive()


@pytest.mark.own_mode  # one process: the `--workers` mode has its own API-death test
def test_a_killed_single_process_server_closes_its_connections_and_frees_the_port(
        servers: ServerPool) -> None:
    """`kill -9` of a one-process server with a request in its 800 ms forward: the client
    gets a transport error at once, not a hang, and the port can be bound again."""
    import socket
    import threading

    server = servers.start("--default-model", SLOW, "--workers", "0", models={
        "slow.yaml": synthetic_model(SLOW, overhead_ms=800, max_batch_items=1)},
        name="kill-one")
    outcome: list[str] = []

    def send() -> None:
        try:
            httpx.post(f"{server.url}/v1/encode/{SLOW}", json=encode_body("x"), timeout=30)
            outcome.append("answered")
        except httpx.TransportError as exc:
            outcome.append(type(exc).__name__)

    thread = threading.Thread(target=send)
    thread.start()
    time.sleep(0.3)  # the request is in its forward
    started = time.monotonic()
    server.process.kill()
    thread.join(10)
    assert outcome and outcome[0] != "answered", outcome
    assert time.monotonic() - started < 5
    server.wait(10)
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", server.port))
