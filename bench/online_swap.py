"""A head swapped in through `POST /v1/admin/head` while clients stream (`bench.online_loop`'s
swap stage), and its verdict: requests dropped, greedy answers changed, programs compiled.

Greedy answers are checked against the same requests answered before the swap (by the head the
server started with): lossless speculative decoding gives the target's greedy output whichever
head drafts, so a greedy request in flight across the swap must answer exactly as before."""

from __future__ import annotations

import itertools
import threading
import time

from bench.online_client import Server, new_result, stream_chat


class Wave:
    """`clients` threads streaming until stopped: thread i alternates a greedy probe (the probes in
    turn, from the i-th) and a sampled request (the next of `sampled`, cycled)."""

    def __init__(self, port: int, probes: list[dict], sampled: list[dict], clients: int):
        self.port, self.probes, self.clients = port, probes, clients
        self.sampled, self.lock = itertools.cycle(sampled), threading.Lock()
        self.results: list[tuple[int, dict, dict]] = []  # (thread, request, result)
        self.current: list[dict | None] = [None] * clients
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self.client, args=(i,), daemon=True) for i in range(clients)]

    def client(self, i: int) -> None:
        for turn in itertools.count():
            if self.stopping.is_set():
                return
            if turn % 2 == 0:
                req = self.probes[(i + turn // 2) % len(self.probes)]
            else:
                with self.lock:
                    req = next(self.sampled)
            res = new_result(req)
            self.current[i] = res
            stream_chat(self.port, req, res)
            with self.lock:
                self.results.append((i, req, res))

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def wait(self, ready, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.1)
        if not ready():
            self.stop()
            raise SystemExit("error: the swap's traffic did not reach the state it waits for (see the server's log)")

    def streaming(self) -> bool:
        """Every thread has a request whose first token has come."""
        return all(res is not None and res["first"] is not None for res in self.current)

    def finished_after(self, t: float) -> bool:
        """Every thread has finished a request it sent after `t`."""
        with self.lock:
            return len({i for i, _, res in self.results if res["sent"] > t}) == self.clients

    def stop(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join()


def swap_under_traffic(server: Server, head: str, admin_key: str, wave: Wave, delay: float, timeout: float) -> dict:
    """The swap to `head` once every thread of `wave` streams (and `delay` s more); the wave goes on
    until every thread has finished a request sent after the swap. The swap's answer, its times,
    and the programs the server compiled from just before it to the wave's end."""
    wave.start()
    wave.wait(wave.streaming, timeout)
    time.sleep(delay)
    before = server.compiles()
    t0 = time.monotonic()
    status, answer = server.swap(head, admin_key)
    t1 = time.monotonic()
    wave.wait(lambda: wave.finished_after(t1), timeout)
    wave.stop()
    return {
        "status": status,
        "answer": answer,
        "swap_started": t0,
        "swap_done": t1,
        "swap_seconds": t1 - t0,
        "compiles": server.compiles() - before,
        "results": [(req, res) for _, req, res in wave.results],
    }


def verdict(swap: dict, references: dict[int, str]) -> dict:
    """Requests dropped (not answered whole) and greedy answers changed (against `references`, the
    text each probe prompt got before the swap), over the whole wave and over the requests in
    flight across the swap (sent before it was done, finished after it began)."""
    t0, t1 = swap["swap_started"], swap["swap_done"]
    results = swap["results"]
    across = [(req, res) for req, res in results if res["sent"] < t1 and res["end"] > t0]

    def counts(pairs) -> dict:
        greedy = [(req, res) for req, res in pairs if req["temperature"] == 0]
        changed = [res for req, res in greedy if res["ok"] and res["text"] != references[req["prompt"]]]
        return {
            "requests": len(pairs),
            "greedy": len(greedy),
            "dropped": sum(not res["ok"] for _, res in pairs),
            "changed": len(changed),
        }

    failures = [f"request {res['index']}: {res['status']} {res['error']}" for _, res in results if not res["ok"]]
    return {
        "swap_status": swap["status"],
        "swap_seconds": round(swap["swap_seconds"], 3),
        "compiles": swap["compiles"],
        "wave": counts(results),
        "across_swap": counts(across),
        "failures": failures[:5],
    }
