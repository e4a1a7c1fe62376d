"""A hostile probe of `python -m infer serve`'s HTTP surface, as an attacker and a careless client.

It builds a tiny random target (train/tiny.py: a word tokenizer over w0..w55) and a random
P-EAGLE head, starts the server on 127.0.0.1 from the code at --server-root (this checkout by
default: point it at another checkout to probe that one), and tries: malformed HTTP, oversize
bodies and heads, slow and vanishing clients, hundreds of idle connections, every field's bad
values, JSON that breaks parsers, the defaults clients send, the stream's usage, the metrics'
growth, a prompt that tokenizes to nothing, a full queue and a stop with streams in flight. It
prints a table (case, expected, got, ok) and writes it as JSON.

    python -m bench.serve_probe [--server-root DIR] [--json OUT.json]

Flags the server does not have (an older checkout) are left out of its command line (read from
its --help): --api-key (the key cases then show generations without a key), --allowed-hosts and
--client-timeout. Each case waits at most a few seconds: a hang is a "got" of its own.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import probe_cases as cases
from bench.probe_client import CLIENT_TIMEOUT, KEY, Client, Row

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- the server


def build_assets(folder: Path) -> None:
    """The trainer's tiny preset target (a random tiny Llama, a word tokenizer over w0..w55), with
    room for long streams, and a random one-layer P-EAGLE head."""
    import peagle_jax as pj
    from train.tiny import build_tiny_target

    build_tiny_target(folder / "target")
    config = folder / "target" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "max_position_embeddings": 2048}))
    target = pj.load_target(folder / "target", dtype="float32")
    pj.new_drafter(target, num_layers=1, mode="parallel", seed=1).save(folder / "drafter")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(server_root: Path, folder: Path, port: int) -> tuple[list[str], set[str]]:
    """The command line, with the optional flags this server has (read from its --help)."""
    env = {**os.environ, "PYTHONPATH": str(server_root)}
    help_text = subprocess.run(
        [sys.executable, "-m", "infer", "serve", "--help"], cwd=server_root, env=env, capture_output=True, text=True
    ).stdout
    cmd = [
        sys.executable,
        "-m",
        "infer",
        "serve",
        "--target",
        str(folder / "target"),
        "--drafter",
        str(folder / "drafter"),
    ]
    cmd += ["--k", "3", "--max-batch", "4", "--max-len", "2048", "--max-queue", "8", "--port", str(port)]
    has = {flag for flag in ("--api-key", "--allowed-hosts", "--client-timeout") if flag in help_text}
    if "--api-key" in has:
        cmd += ["--api-key", KEY]
    if "--allowed-hosts" in has:
        cmd += ["--allowed-hosts", "127.0.0.1", "--allowed-hosts", "localhost"]
    if "--client-timeout" in has:
        cmd += ["--client-timeout", str(CLIENT_TIMEOUT)]
    return cmd, has


def start(server_root: Path, folder: Path, log) -> tuple[subprocess.Popen, int, set[str]]:
    port = free_port()
    cmd, has = server_command(server_root, folder, port)
    env = {**os.environ, "PYTHONPATH": str(server_root)}
    proc = subprocess.Popen(cmd, cwd=server_root, env=env, stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} (see its log)")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc, port, has
        except OSError:
            time.sleep(0.5)
    raise SystemExit("the server did not come up")


def run(server_root: Path, folder: Path, log_path: Path) -> tuple[list[Row], dict]:
    with open(log_path, "wb") as log:
        proc, port, has = start(server_root, folder, log)
        try:
            status, _, text = Client(port, "").http("GET", "/v1/models")
            model = json.loads(text)["data"][0]["id"]
            c = Client(port, model, log_path)
            timeout = CLIENT_TIMEOUT if "--client-timeout" in has else 8.0
            rows = []
            for part in (cases.http, cases.size, cases.json_bodies, cases.fields, cases.accepted, cases.semantic):
                rows += part(c)
            rows += cases.slow(c, timeout)
            rows += cases.queue_and_disconnect(c)
            rows += cases.killer(c, proc)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log_path.read_text(errors="replace")
    logs = {"lines": len(text.splitlines()), "tracebacks": text.count("Traceback"), "flags": sorted(has)}
    rows.append(
        {
            "case": "tracebacks in the server's log",
            "expected": "0",
            "got": str(logs["tracebacks"]),
            "ok": logs["tracebacks"] == 0,
        }
    )
    return rows, logs


def table(rows: list[Row]) -> str:
    lines = ["| case | expected | got | ok |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['expected']} | {r['got']} | {'yes' if r['ok'] else '**no**'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server-root", type=Path, default=ROOT, help="the checkout whose server is probed")
    p.add_argument("--json", type=Path, default=None, help="write the rows and the run's facts here")
    p.add_argument("--log", type=Path, default=None, help="keep the server's log here")
    args = p.parse_args(argv)
    root = args.server_root.resolve()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
    ).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build_assets(folder)
        rows, logs = run(root, folder, folder / "server.log")
        if args.log:
            args.log.write_bytes((folder / "server.log").read_bytes())
    bad = [r for r in rows if not r["ok"]]
    print(table(rows))
    print(f"\n{len(rows)} cases, {len(bad)} not ok; server log: {logs['lines']} lines, {logs['tracebacks']} tracebacks")
    if args.json:
        facts = {
            "title": "serve probe",
            "command": "python -m bench.serve_probe"
            + (f" --server-root {args.server_root}" if args.server_root != ROOT else ""),
            "commit": commit,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.system()}",
            "date": datetime.date.today().isoformat(),
            "log": logs,
            "cases": len(rows),
            "not_ok": len(bad),
            "rows": rows,
        }
        args.json.write_text(json.dumps(facts, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
