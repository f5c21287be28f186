"""``ketch router --epp-port``: the GAIE endpoint picker protocol through a real ext_proc client
(Envoy's own protos, ``tests/extproc_client.py``) against a real router process.

The shared ``ketch serve --runner null`` instances are the model servers where the pick itself
is under test; lightweight real HTTP instances (``FakeInstance``) stand in where a test needs
an instance to change its load, model or role.
"""

from __future__ import annotations

import collections
import json
import random

import extproc_client
import pytest
from epp_harness import address, chat, completion, epp_router, wait_for
from router_harness import FakeInstance, run_router

from procs import free_ports

EXT_PROC = "envoy.service.ext_proc.v3.ExternalProcessor"


@pytest.fixture(scope="module")
def picker(instances):
    urls = ",".join(s.url for s in instances)
    with epp_router("--mixed", urls, "--policy", "prefix-hash", "--health-interval", "0.2") as r:
        wait_for(lambda: r.health("readiness") == "SERVING", "readiness", r)
        yield r


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_each_request_gets_a_ready_instance(picker, instances, streamed, kind):
    ready = {address(s.url) for s in instances}
    for i in range(6):
        body = completion(f"request {i} " * 40) if kind == "completions" else chat(f"hi {i}")
        path = "/v1/completions" if kind == "completions" else "/v1/chat/completions"
        pick = picker.pick(body, streamed=streamed, chunk=97, path=path)
        assert pick.status is None, pick.immediate_body
        assert pick.header == pick.metadata  # the header and envoy.lb metadata agree
        assert pick.primary in ready
        # the ordered fallback list: every ready instance once, the primary first
        assert sorted(pick.destinations) == sorted(ready)
        assert len(set(pick.destinations)) == len(pick.destinations)
        assert "x-ketch-prefill" in pick.removed  # a client's own pairing header never passes
        if streamed:  # FULL_DUPLEX_STREAMED: the body comes back whole, in order
            raw = pick.responses  # headers answer first, then the echoed body
            assert raw[0].WhichOneof("response") == "request_headers"
            assert pick.echoed == json.dumps(body).encode()


def test_the_asyncio_client_sees_the_same_picks(picker, instances):
    import asyncio

    import grpc

    async def both() -> list[extproc_client.Pick]:
        async with grpc.aio.insecure_channel(picker.target) as channel:
            raw = json.dumps(completion("async " * 80)).encode()
            return [await extproc_client.apick(channel, raw, streamed=s) for s in (False, True)]

    for pick in asyncio.run(both()):
        assert pick.primary in {address(s.url) for s in instances}
        assert pick.header == pick.metadata and pick.status is None


def test_a_request_without_body_is_picked_at_its_headers(picker, instances):
    pick = picker.pick(b"", path="/v1/models", headers={":method": "GET"})
    assert pick.primary in {address(s.url) for s in instances}
    assert pick.responses[0].WhichOneof("response") == "request_headers"


def test_subset_hint_is_honoured(picker, instances):
    addresses = [address(s.url) for s in instances]
    for chosen in addresses:
        pick = picker.pick(completion("subset " * 50), subset=["10.255.0.1:1", chosen])
        assert pick.destinations == [chosen] and pick.metadata == chosen
    two = addresses[:2]
    for _ in range(5):
        pick = picker.pick(completion(random.choice("abc") * 300), subset=two)
        assert set(pick.destinations) == set(two)
    assert picker.pick(completion(), subset=[]).status == 503
    assert picker.pick(completion(), subset=["10.255.0.1:1"]).status == 503


def test_prefix_affinity_is_measurable(picker, instances):
    """Requests sharing a long prefix go to one instance far more often than chance (1/3)."""
    rng = random.Random(7)
    groups = [" ".join(rng.choice(["tea", "queen", "dodo", "hare"]) for _ in range(200))
              for _ in range(12)]  # fmt: skip
    order = [g for g in range(len(groups)) for _ in range(5)]
    rng.shuffle(order)
    chosen: dict[int, list[str]] = collections.defaultdict(list)
    for g in order:
        body = completion(groups[g] + f" question {rng.random()}")
        chosen[g].append(picker.pick(body, streamed=bool(g % 2)).primary)
    same = sum(collections.Counter(seen).most_common(1)[0][1] for seen in chosen.values())
    assert same / len(order) >= 0.9, dict(chosen)  # chance alone: about 0.5


def test_response_phases_pass_through(picker):
    body = extproc_client.body_message(b'{"model": "tiny", "prompt": "x"}', True)
    head = extproc_client.request_headers({":path": "/v1/completions"}, False, streamed=True)
    pb = extproc_client.pb
    messages = [
        head,
        body,
        pb.ProcessingRequest(response_headers=pb.HttpHeaders(end_of_stream=False)),
        pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: 1\n\n", end_of_stream=False)),
        pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: 2\n\n", end_of_stream=True)),
        pb.ProcessingRequest(response_trailers=pb.HttpTrailers()),
    ]
    answers = extproc_client.exchange(picker.channel, messages)
    kinds = [a.WhichOneof("response") for a in answers]
    assert kinds == ["request_headers", "request_body", "response_headers", "response_body",
                     "response_body", "response_trailers"]  # fmt: skip
    assert not answers[2].response_headers.response.HasField("header_mutation")
    echoed = [a.response_body.response.body_mutation.streamed_response for a in answers[3:5]]
    assert [e.body for e in echoed] == [b"data: 1\n\n", b"data: 2\n\n"]
    assert [e.end_of_stream for e in echoed] == [False, True]


@pytest.mark.parametrize("streamed", [False, True])
def test_request_trailers_end_the_body(picker, instances, streamed):
    pb = extproc_client.pb
    messages = [
        extproc_client.request_headers({":path": "/v1/completions"}, False, streamed=streamed),
        extproc_client.body_message(b'{"model": "tiny", ', False),
        extproc_client.body_message(b'"prompt": "x"}', False),
        pb.ProcessingRequest(request_trailers=pb.HttpTrailers()),
    ]
    answers = extproc_client.exchange(picker.channel, messages)
    kinds = [a.WhichOneof("response") for a in answers]
    pick = extproc_client.Pick()
    for answer in answers:
        extproc_client._read_pick(pick, answer)
    assert pick.primary in {address(s.url) for s in instances}
    assert kinds == ["request_headers", "request_body", "request_trailers"]
    if streamed:  # the echoed body does not end the stream: the trailers do
        assert pick.echoed == b'{"model": "tiny", "prompt": "x"}'
        assert not answers[1].request_body.response.body_mutation.streamed_response.end_of_stream
    else:  # buffered: the pick answers the body
        assert answers[1].request_body.response.header_mutation.set_headers


def test_health_and_metrics(picker):
    for service in ("", "liveness", "readiness", EXT_PROC):
        assert picker.health(service) == "SERVING"
    assert picker.health("no.such.Service") == "SERVICE_UNKNOWN"
    seen = picker.epp_metrics()
    for outcome in ("picked", "no_endpoint", "rejected", "error"):
        assert f"ketch:epp_requests_total{{outcome={outcome}}}" in seen
    assert seen["ketch:epp_requests_total{outcome=picked}"] >= 1
    assert seen["ketch:epp_decision_seconds_count"] >= 1
    assert seen["ketch:epp_streams"] == 0


def test_metrics_present_before_any_request_and_no_instance_is_503():
    (dead,) = free_ports(1)  # nothing listens there
    with epp_router("--mixed", f"127.0.0.1:{dead}", "--health-interval", "0.1") as r:
        seen = r.epp_metrics()
        for outcome in ("picked", "no_endpoint", "rejected", "error"):
            assert seen[f"ketch:epp_requests_total{{outcome={outcome}}}"] == 0
        assert seen["ketch:epp_decision_seconds_count"] == 0 and seen["ketch:epp_streams"] == 0
        assert r.health("liveness") == "SERVING" and r.health("") == "SERVING"
        assert r.health("readiness") == "NOT_SERVING" and r.health(EXT_PROC) == "NOT_SERVING"
        for streamed in (False, True):
            pick = r.pick(completion(), streamed=streamed)
            assert pick.status == 503 and not pick.destinations
            assert b"no ready instance" in pick.immediate_body
        assert r.epp_metrics()["ketch:epp_requests_total{outcome=no_endpoint}"] == 2
        late = FakeInstance(port=dead)  # the instance comes up: readiness follows
        try:
            wait_for(lambda: r.health("readiness") == "SERVING", "readiness", r)
            assert r.pick(completion()).destinations == [f"127.0.0.1:{dead}"]
        finally:
            late.stop()
        wait_for(lambda: r.health("readiness") == "NOT_SERVING", "readiness drop", r)


def test_saturated_instances_shed_429():
    fakes = [FakeInstance(), FakeInstance()]
    try:
        urls = ",".join(f.url for f in fakes)
        with epp_router("--mixed", urls, "--epp-shed-load", "4", "--health-interval", "0.1") as r:
            wait_for(lambda: r.health("readiness") == "SERVING", "readiness", r)
            fakes[0].metrics_text = "ketch:num_requests_running 3\nketch:num_requests_waiting 9\n"
            busy = [address(fakes[0].url)]
            wait_for(lambda: r.pick(completion(), subset=busy).status == 429, "429", r)
            assert r.pick(completion()).primary == address(fakes[1].url)  # one has room
            fakes[1].metrics_text = fakes[0].metrics_text
            wait_for(lambda: r.pick(completion()).status == 429, "429 for all", r)
            assert r.epp_metrics()["ketch:epp_requests_total{outcome=rejected}"] >= 2
    finally:
        for fake in fakes:
            fake.stop()


def test_unknown_model_is_404_and_models_route_to_their_instances():
    fakes = [FakeInstance(), FakeInstance()]
    for fake, model in zip(fakes, ("alpha", "beta"), strict=True):
        fake.ready_body = f'{{"ready": true, "role": "mixed", "model": "{model}"}}'.encode()
    try:
        with epp_router("--mixed", ",".join(f.url for f in fakes)) as r:
            wait_for(lambda: r.health("readiness") == "SERVING", "readiness", r)
            for _ in range(3):
                assert r.pick({"model": "beta", "prompt": "x"}).destinations == [
                    address(fakes[1].url)
                ]
            pick = r.pick({"model": "gamma", "prompt": "x"})
            assert pick.status == 404 and b"alpha, beta" in pick.immediate_body
    finally:
        for fake in fakes:
            fake.stop()


def test_prefill_decode_pairing_header():
    prefill = FakeInstance(role="prefill", pd_comm_port=7301)
    decodes = [FakeInstance(role="decode"), FakeInstance(role="decode")]
    try:
        args = ("--prefill", prefill.url, "--decode", ",".join(d.url for d in decodes))
        with epp_router(*args) as r:
            wait_for(lambda: r.health("readiness") == "SERVING", "readiness", r)
            wanted = {address(d.url) for d in decodes}
            for streamed in (False, True):
                pick = r.pick(
                    completion(), streamed=streamed, headers={"x-ketch-prefill": "evil:1"}
                )
                assert set(pick.destinations) == wanted and pick.header == pick.metadata
                assert pick.headers["x-ketch-prefill"] == "127.0.0.1:7301"
            # the subset hint limits the destination (decode), not the prefill peer
            only = address(decodes[1].url)
            pick = r.pick(completion(), subset=[only])
            assert pick.destinations == [only]
            assert pick.headers["x-ketch-prefill"] == "127.0.0.1:7301"
            # embeddings need no pair: the prefill instance computes them, no header
            pick = r.pick({"model": "tiny", "input": "x"}, path="/v1/embeddings")
            assert pick.primary == address(prefill.url) and "x-ketch-prefill" in pick.removed
    finally:
        for fake in (prefill, *decodes):
            fake.stop()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--epp-port", "0"), "epp_port must be a port number"),
        (("--epp-port", "70000"), "epp_port must be a port number"),
        (("--port", "9100", "--epp-port", "9100"), "epp_port must differ"),
        (("--epp-port", "9002", "--epp-max-streams", "0"), "epp_max_streams"),
        (("--epp-port", "9002", "--epp-shed-load", "-1"), "epp_shed_load"),
    ],
)
def test_bad_epp_settings_fail_fast(flags, message):
    done = run_router("--mixed", "127.0.0.1:1", *flags)
    assert done.returncode != 0
    assert message in done.stderr + done.stdout


def test_listening_ports_name_the_epp_port():
    """What the operator's wiring checks read: the EPP port is a gRPC (not HTTP) listener."""
    from ketch.engine.cli import build_parser, listening_ports

    args = build_parser().parse_args(["router"])
    ports = listening_ports(args, {"mixed": "10.0.0.5:8000", "epp_port": 9002})
    assert ports == {9000: "--port", 9002: "--epp-port"}
    assert ports[9000].http and not ports[9002].http
    assert listening_ports(args, {"mixed": "10.0.0.5:8000"}) == {9000: "--port"}


def test_epp_port_from_the_config_file(tmp_path):
    from ketch.engine.cli import build_parser
    from ketch.engine.router.cli import config_from

    path = tmp_path / "router.yaml"
    path.write_text("mixed: 10.0.0.5:8000\nepp_port: 9002\nepp_shed_load: 16\n")
    config = config_from(build_parser().parse_args(["router", "--config", str(path)]))
    assert (config.epp_port, config.epp_shed_load, config.epp_max_streams) == (9002, 16, 4096)
    path.write_text("mixed: 10.0.0.5:8000\nepp_port: '9002'\n")
    with pytest.raises(ValueError, match="epp_port must be a port number"):
        config_from(build_parser().parse_args(["router", "--config", str(path)]))


def test_sigterm_stops_the_picker_and_frees_its_port():
    import socket

    from epp_harness import EppRouter

    fake = FakeInstance()
    try:
        router = EppRouter("--mixed", fake.url)
        wait_for(lambda: router.health("readiness") == "SERVING", "readiness", router)
        assert router.pick(completion()).primary == address(fake.url)
        assert router.stop() == 0
        with socket.socket() as sock:  # nothing is left listening on the gRPC port
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", router.epp_port))
    finally:
        fake.stop()


def test_sigterm_lets_open_streams_finish():
    """A stream in its response phases when SIGTERM comes is still answered; then the router
    exits 0, and readiness no longer says SERVING."""
    import signal

    from epp_harness import EppRouter

    fake = FakeInstance()
    router = EppRouter("--mixed", fake.url, "--drain-timeout", "60")
    try:
        wait_for(lambda: router.health("readiness") == "SERVING", "readiness", router)
        stream = extproc_client._Stream(router.channel, timeout=60)
        stream.send(extproc_client.request_headers({":path": "/v1/models"}, True))
        first = stream.receive()
        assert first.request_headers.response.header_mutation.set_headers
        router.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: router.health("readiness") != "SERVING", "readiness drop", router)
        pb = extproc_client.pb
        stream.send(pb.ProcessingRequest(response_headers=pb.HttpHeaders(end_of_stream=True)))
        assert stream.receive().WhichOneof("response") == "response_headers"
        assert router.proc.poll() is None  # held open by the stream
        stream.close()
        assert router.proc.wait(60) == 0
    finally:
        router.stop()
        fake.stop()
