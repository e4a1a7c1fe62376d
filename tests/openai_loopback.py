"""A loopback OpenAI-compatible server for the regeneration tests, on 127.0.0.1 in a thread.

It speaks what vLLM speaks to `train.regenerate_endpoint`: GET `v1/models`, POST `v1/completions`
(a token-id prompt) and `v1/chat/completions` (messages, templated with the project's own
`peagle_jax.conversations.chat.encode_prompt`), greedy only (temperature 0), `stop_token_ids` added to the
target's eos ids, `token_ids` / `prompt_token_ids` in the reply when `return_token_ids` asks.
The answers are the project's own engine's (`peagle_jax.engine.generate_greedy`) on a real target.

Faults on demand (`Faults`): the first POSTs answered 500 or 400, every POST answered 500, replies held
back (a client's timeout, or a run interrupted while it waits), a server that drops a request and stops listening after N answers, or
text without token ids (SGLang, vLLM before 0.10.2)."""

from __future__ import annotations

import dataclasses
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from peagle_jax.conversations.chat import encode_prompt
from peagle_jax.engine import generate_greedy


@dataclasses.dataclass
class Faults:
    fail_first: int = 0  # POSTs answered 500 before the first real answer
    fail_always: bool = False  # every POST answered 500 (GET v1/models still answers)
    refuse_first: int = 0  # POSTs answered 400: a request no retry can cure
    hold: float = 0.0  # seconds a POST is held before it is answered (released when the server closes)
    hold_after: int = 0  # POSTs served before the rest are held
    die_after: int | None = None  # answers given before the server drops a request and stops listening
    token_ids: bool = True  # honour return_token_ids (False: text only)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # close() does not wait for a held request

    def handle_error(self, request, client_address):
        pass  # a client that timed out and left: expected in these tests


class LoopbackServer:
    """`with LoopbackServer(target, Faults(...)) as server:` serves `server.url` (…/v1);
    `posts` (as they arrive), `answered`, `failed` (500) and `refused` (400) count what it saw."""

    MODEL = "loopback-target"

    def __init__(self, target, faults: Faults | None = None):
        self.target, self.faults = target, faults or Faults()
        self.lock, self.closing = threading.Lock(), threading.Event()
        self.posts = self.answered = self.failed = self.refused = 0
        self.dead = False
        self.httpd = _Server(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self.closing.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def _die(self) -> None:
        """Stop listening (from another thread: shutdown waits for the serving loop)."""
        self.dead = True
        threading.Thread(target=self.close, daemon=True).start()

    # ------------------------------------------------------------------ answers
    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.MODEL, "object": "model", "max_model_len": 512}]}

    def complete(self, route: str, body: dict) -> tuple[int, dict]:
        if body.get("temperature") != 0 or body.get("n", 1) != 1 or body.get("model") != self.MODEL:
            return 400, {"error": {"message": "the loopback serves one greedy choice of its model only"}}
        chat = route.endswith("/chat/completions")
        prompt = encode_prompt(self.target.tokenizer, body["messages"]) if chat else list(body["prompt"])
        eos = sorted(set(self.target.eos_token_ids) | set(body.get("stop_token_ids") or ()))
        toks = generate_greedy(self.target, [prompt], body["max_tokens"], eos=eos)[0]
        text = self.target.tokenizer.decode(toks, skip_special_tokens=True)
        choice = {"index": 0, "finish_reason": "stop" if toks and toks[-1] in eos else "length"}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        if body.get("return_token_ids") and self.faults.token_ids:
            choice.update(token_ids=toks, prompt_token_ids=prompt)
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(toks)}
        return 200, {"object": "chat.completion" if chat else "text_completion", "choices": [choice], "usage": usage}

    def post(self, route: str, body: dict) -> tuple[int, dict] | None:
        """(status, reply) of a POST; None: drop the connection unanswered."""
        f = self.faults
        with self.lock:
            self.posts += 1
            held = f.hold and self.posts > f.hold_after
        if held and (self.closing.wait(f.hold) or self.closing.is_set()):
            return None  # released by close(): the test is over
        with self.lock:
            if self.dead or (f.die_after is not None and self.answered >= f.die_after):
                self._die()
                return None
            if self.refused < f.refuse_first:
                self.refused += 1
                return 400, {"error": {"message": "loopback: bad request (on purpose)"}}
            if f.fail_always or self.failed < f.fail_first:
                self.failed += 1
                return 500, {"error": {"message": "loopback: internal error (on purpose)"}}
            status, reply = self.complete(route, body)
            self.answered += status == 200
            return status, reply


def _handler(app: LoopbackServer):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path.rstrip("/") == "/v1/models":
                self._send(200, app.models())
            else:
                self._send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path not in ("/v1/completions", "/v1/chat/completions"):
                self._send(404, {"error": {"message": f"no route {self.path}"}})
                return
            got = app.post(self.path, body)
            if got is None:
                self.close_connection = True  # the request read, no reply: a server that died mid-run
                return
            self._send(*got)

    return Handler
