"""Benchmark: KV transfer throughput through two real cache managers, against raw ZMQ.

Two ``ketch cache-manager`` processes run on loopback, each attached to a KV segment in
/dev/shm with a 0.5B-model-like layout (24 layers, 2 KV heads, head_dim 64, block 64 tokens:
0.79 MB per block). This script plays the prefill engine: it sends ``Push`` messages of B blocks
and waits for ``PushDone``; what is timed is the engine's view (queue round trip, gather,
transfer, scatter into the peer's segment, acknowledgement).

The baseline, measured in the same run: the same bytes as one frame from a DEALER in this
process to a ROUTER in another process, which answers a one-frame ack (raw ZMQ, no copies).
The ratio column is cache-manager MB/s / raw MB/s; the target is >= 0.7.

A second table (``--handover``, on by default) times the hand-over end to end through real
processes: a prefill and a decode ``ketch serve --model tiny`` instance, each with its cache
manager, serve completions of P-token prompts; the decode instance's ``ketch:kv_handover_seconds``
histogram (prefill's end of prefill to the decode engine taking the request over, right before
its first decode step) gives the mean per prompt size, next to the time to first token of the
same prompts on a mixed ``ketch serve`` (the baseline, measured in the same run).

Run as a script, ``.venv/bin/python benchmarks/bench_kv_transfer.py [--pushes 20]``.
Timings on a shared machine vary; compare rows of one run, and the ratio column.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import zmq

from ketch.engine import rundir
from ketch.engine.cache_manager import protocol as p

KETCH = shutil.which("ketch", path=str(Path(sys.executable).parent)) or "ketch"
LAYOUT = {"num_layers": 24, "kv_heads": 2, "block_size": 64, "head_dim": 64}
BATCHES = (16, 32, 64)
TARGET_RATIO = 0.7


def free_ports(count: int) -> list[int]:
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


def raw_receiver(port: int) -> None:
    """The baseline's peer: a ROUTER that acks every message (runs in its own process)."""
    sock = zmq.Context().socket(zmq.ROUTER)
    sock.bind(f"tcp://127.0.0.1:{port}")
    while True:
        frames = sock.recv_multipart(copy=False)
        if len(frames[1]) == 0:
            break
        sock.send_multipart([frames[0].bytes, b"ok"])


def measure_raw(nbytes: int, pushes: int) -> list[float]:
    (port,) = free_ports(1)
    proc = multiprocessing.get_context("spawn").Process(target=raw_receiver, args=(port,))
    proc.start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    data = np.random.default_rng(0).standard_normal(nbytes // 4).astype(np.float32)
    times = []
    for i in range(pushes + 1):
        start = time.perf_counter()
        sock.send(data, copy=False)
        sock.recv()
        if i:  # the first one connects
            times.append(time.perf_counter() - start)
    sock.send(b"")
    proc.join(10)
    sock.close(linger=0)
    return times


class Instance:
    """A KV segment plus the cache manager attached to it, and the engine's DEALER."""

    def __init__(self, num_blocks: int, seed: int, role: str) -> None:
        self.layout = p.KVLayout(
            **LAYOUT, num_blocks=num_blocks, segment=f"ketch-bench-kv-{uuid.uuid4().hex[:8]}"
        )
        self.path = Path("/dev/shm") / self.layout.segment
        with self.path.open("wb") as f:
            f.truncate(int(np.prod(self.layout.shape)) * 4)
        self.kv = np.memmap(self.path, dtype=np.float32, mode="r+", shape=self.layout.shape)
        self.kv[:] = np.random.default_rng(seed).standard_normal(self.layout.shape)
        queue_port, self.kv_port, http_port = free_ports(3)
        self.log_path = tempfile.mkstemp(prefix="ketch-bench-cm-", suffix=".log")[1]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [KETCH, "cache-manager", "--host", "127.0.0.1", "--log-level", "WARNING",
                 "--cache-queue-port", str(queue_port), "--kv-transfer-port", str(self.kv_port),
                 "--cache-manager-port", str(http_port), "--swap-space", "0",
                 "--role", role, "--insecure-no-peer-key"],
                stdout=log, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir(),
            )  # fmt: skip
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        try:  # a failed start leaves no cache manager behind
            deadline = time.monotonic() + 30
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"http://127.0.0.1:{http_port}/health").status_code == 200:
                        break
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"cache manager did not start; log: {self.log_path}")
                time.sleep(0.05)
            self.engine_id = uuid.uuid4().hex[:8]
            self.sock.connect(rundir.cache_queue_address(queue_port))
            self.hello()
        except BaseException:
            self.close()
            raise

    def hello(self) -> None:
        """Attaches (a Hello again would drop the reservations made since)."""
        ack = self.ask(p.Hello(self.engine_id, p.PROTOCOL_VERSION, self.layout))
        assert isinstance(ack, p.HelloAck) and ack.error is None, ack

    def ping(self) -> None:
        """The engine's heartbeat: a cache manager detaches an engine silent for 5 s."""
        assert isinstance(self.ask(p.Ping(self.engine_id)), p.Pong)

    def reserve(self, request_id: str, blocks: list[int]) -> str:
        """Reserves ``blocks`` for ``request_id`` as the decode engine does; returns the nonce."""
        nonce = uuid.uuid4().hex
        done = self.ask(p.Reserve(request_id, blocks, nonce, ttl=60.0))
        assert isinstance(done, p.Reserved) and done.ok, done
        return nonce

    def push(self, request_id: str, blocks: list[int], dst: Instance, dest: list[int]) -> p.Message:
        """Pushes ``blocks`` into ``dest`` of ``dst``, reserved there first (untimed)."""
        nonce = dst.reserve(request_id, dest)
        start = time.perf_counter()
        done = self.ask(
            p.Push(request_id, blocks, f"127.0.0.1:{dst.kv_port}", dest, dst.engine_id, nonce)
        )
        self.last_push_s = time.perf_counter() - start
        return done

    def ask(self, message: p.Message) -> p.Message:
        self.sock.send(p.encode(message))
        if not self.sock.poll(60_000):
            raise RuntimeError("the cache manager did not answer within 60 s")
        return p.decode(self.sock.recv())

    def close(self) -> None:
        self.sock.close(linger=0)
        self.proc.terminate()
        self.proc.wait(10)
        del self.kv
        self.path.unlink(missing_ok=True)


def measure_push(src: Instance, dst: Instance, batch: int, pushes: int) -> list[float]:
    rng = np.random.default_rng(batch)
    times: list[float] = []
    inside: list[float] = []  # PushDone.seconds: gather + transfer + ack, as the sender saw it
    src.hello()
    dst.hello()
    for i in range(pushes + 1):
        dst.ping()  # the decode engine's heartbeat, untimed
        blocks = [int(b) for b in rng.choice(np.arange(1, src.layout.num_blocks), batch, False)]
        dest = [int(b) for b in rng.choice(np.arange(1, dst.layout.num_blocks), batch, False)]
        done = src.push(f"bench-{batch}-{i}", blocks, dst, dest)
        elapsed = src.last_push_s
        assert isinstance(done, p.PushDone) and done.ok, done
        if i:
            times.append(elapsed)
            inside.append(done.seconds)
    assert np.array_equal(dst.kv[:, :, :, dest], src.kv[:, :, :, blocks]), "blocks differ"
    print(f"   (sender-side PushDone.seconds p50 {statistics.median(inside) * 1e3:.1f} ms)")
    return times


def warm_up(src: Instance, dst: Instance) -> None:
    """Pushes every block once, untimed: both processes fault in their segment's pages."""
    every = list(range(1, min(src.layout.num_blocks, dst.layout.num_blocks)))
    for start in range(0, len(every), 16):
        blocks = every[start : start + 16]
        done = src.push(f"warm-up-{start}", blocks, dst, blocks)
        assert isinstance(done, p.PushDone) and done.ok, done
        dst.ping()


def _harness() -> None:
    """Makes the tests' process harnesses (pd_harness, serve_harness, cm_harness) importable."""
    tests = Path(__file__).resolve().parent.parent / "tests" / "engine"
    for sub in ("disagg", "serving", "cache_manager"):
        if str(tests / sub) not in sys.path:
            sys.path.insert(0, str(tests / sub))


def complete(url: str, prompt: list[int], headers: dict[str, str] | None = None) -> float:
    """One greedy completion of one token; returns its latency in seconds."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    start = time.perf_counter()
    response = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)
    elapsed = time.perf_counter() - start
    response.raise_for_status()
    return elapsed


def measure_handover(sizes: list[int], repeats: int) -> None:
    """The second table: prefill -> decode hand-over against a mixed instance's TTFT."""
    _harness()
    from pd_harness import Pod
    from serve_harness import Server, metric, scrape

    pods: list[Pod] = []
    mixed = None
    try:
        pods = [Pod("prefill", swap_space="0"), Pod("decode", swap_space="0")]
        mixed = Server()
        for pod in pods:
            pod.wait_ready()
        mixed.wait_ready()
        prefill, decode = pods
        headers = {"x-ketch-prefill": prefill.pd_address}
        print(f"\nhand-over, tiny model, block 16, {repeats} requests per prompt size (means)")
        print(f"{'tokens':>6} {'handover ms':>11} {'pd e2e ms':>9} {'mixed TTFT ms':>13} "
              f"{'handover/TTFT':>13}")  # fmt: skip
        rng = np.random.default_rng(0)
        for size in sizes:
            prompts = [[int(t) for t in rng.integers(1, 200, size)] for _ in range(repeats + 1)]
            complete(decode.url, prompts[0], headers)  # warm-up: compiles this shape, untimed
            complete(mixed.url, prompts[0])
            before = scrape(decode.url)
            pd = [complete(decode.url, prompt, headers) for prompt in prompts[1:]]
            after = scrape(decode.url)
            count = metric(after, "kv_handover_seconds_count") - metric(
                before, "kv_handover_seconds_count"
            )
            total = metric(after, "kv_handover_seconds_sum") - metric(
                before, "kv_handover_seconds_sum"
            )
            ttft = statistics.mean(complete(mixed.url, prompt) for prompt in prompts[1:])
            handover = total / count if count else float("nan")
            print(
                f"{size:>6} {handover * 1e3:>11.1f} {statistics.mean(pd) * 1e3:>9.1f} "
                f"{ttft * 1e3:>13.1f} {handover / ttft:>13.2f}"
            )
    finally:
        for pod in pods:
            pod.stop()
        if mixed is not None:
            mixed.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pushes", type=int, default=20, help="timed pushes per batch size")
    parser.add_argument("--num-blocks", type=int, default=160, help="blocks per KV segment")
    parser.add_argument(
        "--handover", action=argparse.BooleanOptionalAction, default=True,
        help="also time the prefill -> decode hand-over through real ketch serve instances",
    )  # fmt: skip
    parser.add_argument("--prompt-tokens", default="64,256,500", help="hand-over prompt sizes")
    parser.add_argument("--requests", type=int, default=5, help="hand-over requests per size")
    args = parser.parse_args()
    src = Instance(args.num_blocks, 1, "prefill")
    try:
        dst = Instance(args.num_blocks, 2, "decode")
    except BaseException:
        src.close()
        raise
    block_bytes = src.layout.block_bytes
    print(f"layout {LAYOUT}: {block_bytes / 1e6:.2f} MB/block; {args.pushes} pushes per row")
    print(f"{'blocks':>6} {'MB':>6} {'raw MB/s':>9} {'cm MB/s':>9} {'ratio':>6} "
          f"{'raw ms':>7} {'cm ms p50':>9} {'cm ms max':>9}")  # fmt: skip
    ratios = []
    try:
        warm_up(src, dst)
        for batch in BATCHES:
            nbytes = batch * block_bytes
            raw = statistics.median(measure_raw(nbytes, args.pushes))
            push_times = measure_push(src, dst, batch, args.pushes)
            cm = statistics.median(push_times)
            ratio = raw / cm
            ratios.append(ratio)
            print(
                f"{batch:>6} {nbytes / 1e6:>6.1f} {nbytes / raw / 1e6:>9.0f} "
                f"{nbytes / cm / 1e6:>9.0f} {ratio:>6.2f} {raw * 1e3:>7.1f} "
                f"{cm * 1e3:>9.1f} {max(push_times) * 1e3:>9.1f}"
            )
    finally:
        src.close()
        dst.close()
    verdict = "met" if min(ratios) >= TARGET_RATIO else "MISSED"
    print(f"target: cache-manager/raw >= {TARGET_RATIO} at every batch size: {verdict}")
    if args.handover:
        sizes = [int(size) for size in args.prompt_tokens.split(",")]
        measure_handover(sizes, args.requests)


if __name__ == "__main__":
    main()
