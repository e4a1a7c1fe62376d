"""Learning from traffic, as one command: serve Gemma-3-270M with a head, drive the server with one
domain's prompts the head was not trained on (HumanEval's) from streaming clients, fine-tune the
head on the server's request log for a fixed time, swap the fine-tuned head in through
`POST /v1/admin/head` while clients keep streaming, and measure acceptance length (K = 7, greedy)
of both heads on the domain's held-out prompts and on MT-Bench.

    python -m bench.online_loop [--work runs/online-loop] [--head DIR] [--requests 500] \\
        [--train-minutes 10] [--json bench/results/online_loop.json]

Stages, each kept in the work folder (a rerun continues from the first one not done; each stage's
time is logged in WORK/stages.jsonl):
  head      --head DIR, or the demo head trained as `make demo` does (python -m train: P-EAGLE for
            Gemma-3-270M on ShareGPT) into WORK/demo, its final evaluation left to this script
  traffic   the server with the head (--log-requests WORK/log --admin-key), --requests streaming
            chat requests from --clients threads: HumanEval's 164 prompts split by a seeded shuffle
            into --heldout never sent and the rest served, each served prompt first greedy, then
            sampled at --temperature with seeds (WORK/traffic.jsonl: one line per answer)
  probe     the fine-tune's step time, from a short run (WORK/probe)
  finetune  python -m train --data.source WORK/log --model.init_head HEAD for the steps that fill
            --train-minutes (WORK/TUNE; --tune names a variant, --finetune-flags adds trainer flags)
  swap      the server again with the starting head: greedy probes answered, then --clients threads
            streaming (greedy probes and sampled requests) while the fine-tuned head is swapped in;
            requests dropped, greedy answers changed against before, programs compiled
            (JAX_LOG_COMPILES=1) from the swap to the end of its traffic (WORK/TUNE-swap.json)
  accept    acceptance length at K of each head on the held-out prompts and on MT-Bench (greedy,
            SpeculativeDecoder.generate; WORK/accept/)
then the results (--json), which `python -m bench.render_results` renders into docs/benchmarks.md.

--smoke runs the whole loop on the trainer's tiny preset target (a random tiny Llama with a word
tokenizer) with word prompts of two 'domains', in about a minute: a check of the machinery, not a
measurement.
"""

from __future__ import annotations

import argparse
import json
import secrets
import shlex
import subprocess
import sys
import time
from pathlib import Path

from bench import online_plan as plan
from bench.command import command_line
from bench.online_client import Server, drive
from bench.online_results import assemble, write_results
from bench.online_swap import Wave, swap_under_traffic, verdict

ROOT = Path(__file__).resolve().parent.parent
FINETUNE_FLAGS = ["--data.max_len", "512"]  # HumanEval prompts (median 146 tokens) with their answers
SMOKE = {"requests": 16, "heldout": 4, "clients": 4, "max_tokens": 24, "swap_tokens": 160, "k": 3}
SMOKE |= {"eval_tokens": 24, "eval_batch": 4, "probe_steps": 3, "train_minutes": 0.1}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.online_loop", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--work", type=Path, default=Path("runs/online-loop"), help="the work folder (rerun: resume)")
    p.add_argument("--head", help="the starting head (default: the demo head, trained into WORK/demo)")
    p.add_argument("--requests", type=int, default=500, help="requests served before the fine-tune")
    p.add_argument("--heldout", type=int, default=34, help="HumanEval prompts held out (never sent)")
    p.add_argument("--seed", type=int, default=0, help="the prompt split's and the requests' seed")
    p.add_argument("--clients", type=int, default=8, help="concurrent streaming clients (= the server's slots)")
    p.add_argument("--max-tokens", type=int, default=256, help="max_tokens of a served request")
    p.add_argument("--temperature", type=float, default=0.7, help="of the sampled requests")
    p.add_argument("--train-minutes", type=float, default=10.0, help="the fine-tune's training time")
    p.add_argument("--train-steps", type=int, help="the fine-tune's steps (default: what --train-minutes holds)")
    p.add_argument("--probe-steps", type=int, default=8, help="steps of the step-time probe")
    p.add_argument("--tune", default="finetune", help="the fine-tune's name: WORK/TUNE (a variant: another name)")
    p.add_argument("--finetune-flags", default="", help="more python -m train flags for the fine-tune")
    p.add_argument("--swap-tokens", type=int, default=128, help="max_tokens of the swap's requests")
    p.add_argument("--k", type=int, default=7, help="drafts per round, served and measured")
    p.add_argument("--eval-tokens", type=int, default=128, help="new tokens per prompt measured")
    p.add_argument("--eval-batch", type=int, default=8, help="prompts decoded together when measuring")
    p.add_argument("--json", type=Path, help="the results (default: bench/results/online_loop.json; --smoke: WORK)")
    p.add_argument("--smoke", action="store_true", help="the tiny preset target, tiny sizes (seconds)")
    args = p.parse_args(argv)
    if args.smoke:
        given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in (argv or sys.argv[1:]) if a.startswith("--")}
        for name, value in SMOKE.items():
            if name not in given:
                setattr(args, name, value)
    args.json = args.json or (args.work / "online_loop.json" if args.smoke else ROOT / "bench/results/online_loop.json")
    return args


class Loop:
    """The work folder, the target and the prompt sets of one run of the loop."""

    def __init__(self, args: argparse.Namespace):
        from peagle_jax.engine import load_prompts

        self.args, self.work = args, args.work
        self.work.mkdir(parents=True, exist_ok=True)
        if args.smoke:
            from train.tiny import build_tiny_target

            self.target = str(build_tiny_target(self.work / "target"))
            self.target_shown = str(self.work / "target")
            self.domain, self.other = plan.smoke_prompts(24, 0, args.seed), plan.smoke_prompts(8, 1, args.seed)
            self.names = ("words 0-27", "words 28-55")
        else:
            from peagle_jax.sources.assets import prepare

            self.target, self.target_shown = str(prepare("gemma3-270m")), "$(python -m peagle_jax.assets gemma3-270m)"
            self.domain, self.other = load_prompts("humaneval"), load_prompts("mtbench")
            self.names = ("HumanEval", "MT-Bench")
        self.served, self.heldout = plan.split_prompts(len(self.domain), args.heldout, args.seed)
        self.requests = plan.plan_requests(self.served, args.requests, args.max_tokens, args.temperature, args.seed)
        self.times: dict[str, float] = {}

    # ------------------------------------------------------------------ bookkeeping
    def stage(self, name: str, done: Path, run) -> None:
        """Runs stage `name` unless `done` exists; its time goes to WORK/stages.jsonl."""
        if done.exists():
            print(f"[online_loop] {name}: done before ({done})", flush=True)
            return
        print(f"[online_loop] {name}: start", flush=True)
        t0 = time.perf_counter()
        run()
        seconds = time.perf_counter() - t0
        self.times[name] = seconds
        with (self.work / "stages.jsonl").open("a") as f:
            f.write(json.dumps({"stage": name, "seconds": round(seconds, 1), "finished": time.time()}) + "\n")
        print(f"[online_loop] {name}: done in {seconds:.0f} s", flush=True)

    def shown(self, argv: list[str]) -> str:
        """A command as a user reruns it: the prepared target's folder as the command that prints it."""
        return shlex.join(argv).replace(shlex.quote(self.target), self.target_shown)

    def trainer(self, argv: list[str], log: Path) -> None:
        """`python -m train ARGV`, its output in `log`; a failure ends the loop with one line."""
        with log.open("ab") as out:
            code = subprocess.call([sys.executable, "-m", "train", *argv], cwd=ROOT, stdout=out, stderr=out)
        if code != 0:
            raise SystemExit(f"error: python -m train exited with {code} (its output: {log})")

    def request(self, req: dict, **more) -> dict:
        return {**req, "messages": self.domain[req["prompt"]], **more}

    def server(self, head: str, log_dir: Path, stderr: Path, admin_key: str) -> Server:
        a = self.args
        argv = ["--target", self.target, "--drafter", head, "--k", str(a.k), "--max-batch", str(a.clients)]
        argv += ["--max-queue", str(4 * a.clients), "--log-requests", str(log_dir), "--admin-key", admin_key]
        if a.smoke:
            argv += ["--max-len", "256", "--prefill-chunk", "64"]
        return Server(argv, stderr, env={"JAX_LOG_COMPILES": "1"})

    # ------------------------------------------------------------------ stages
    @property
    def head(self) -> str:
        return self.args.head or str(self.work / "demo" / "head")

    def head_command(self) -> list[str]:
        argv = ["--out", str(self.work / "demo"), "--eval.enabled", "false", "--loop.progress", "false"]
        if self.args.smoke:
            argv += ["--preset", "tiny", "--model.target", self.target, "--loop.steps", "20"]
        return argv

    def train_head(self) -> None:
        self.trainer(self.head_command(), self.work / "demo.txt")

    def traffic(self) -> None:
        """The requests not answered yet (WORK/traffic.jsonl), through a server logging into WORK/log."""
        done_file = self.work / "traffic.jsonl"
        done = {json.loads(line)["index"] for line in done_file.open()} if done_file.exists() else set()
        todo = [self.request(r) for r in self.requests if r["index"] not in done]
        server = self.server(self.head, self.work / "log", self.work / "traffic-server.log", secrets.token_hex(16))
        t0 = time.perf_counter()
        with done_file.open("a") as out:

            def on_done(req, res):
                line = {k: req[k] for k in ("index", "prompt", "temperature", "seed")}
                line |= {k: res[k] for k in ("ok", "status", "error", "finish", "tokens")}
                out.write(json.dumps(line | {"seconds": res["end"] - res["sent"]}) + "\n")
                out.flush()

            try:
                drive(server.port, todo, self.args.clients, on_done)
            finally:
                code = server.stop()
        self.record("traffic", {"seconds": time.perf_counter() - t0, "sent": len(todo), "server_exit": code})
        (self.work / "traffic.done").write_text("")

    def record(self, name: str, data: dict) -> None:
        with (self.work / f"{name}-runs.jsonl").open("a") as f:
            f.write(json.dumps(data) + "\n")

    def finetune_command(self, out: Path, steps: int) -> list[str]:
        a = self.args
        argv = ["--model.target", self.target, "--data.source", str(self.work / "log")]
        argv += ["--model.init_head", self.head, "--out", str(out), "--loop.steps", str(steps)]
        argv += ["--eval.enabled", "false", "--loop.progress", "false"]
        argv += ["--preset", "tiny"] if a.smoke else FINETUNE_FLAGS
        return argv + shlex.split(a.finetune_flags)

    def probe(self) -> None:
        out = self.work / "probe"
        self.trainer(self.finetune_command(out, self.args.probe_steps), self.work / "probe.txt")
        seconds = plan.step_seconds(out / "metrics.jsonl")
        (self.work / "probe.json").write_text(json.dumps({"step_seconds": seconds, "steps": self.args.probe_steps}))

    def steps(self) -> int:
        if self.args.train_steps:
            return self.args.train_steps
        seconds = json.loads((self.work / "probe.json").read_text())["step_seconds"]
        return plan.steps_for(60 * self.args.train_minutes, seconds)

    def finetune(self) -> None:
        out = self.work / self.args.tune
        argv = self.finetune_command(out, self.steps())
        cap = 1.5 * 60 * self.args.train_minutes  # a slower machine than the probe saw: stop, export what it has
        argv += [] if self.args.train_steps else ["--loop.max_seconds", str(cap)]
        (self.work / f"{self.args.tune}.command").write_text(self.shown(["python", "-m", "train", *argv]) + "\n")
        self.trainer(argv, self.work / f"{self.args.tune}.txt")

    def swap(self) -> None:
        """The fine-tuned head swapped in under traffic; WORK/TUNE-swap.json holds the verdict."""
        a, key = self.args, secrets.token_hex(16)
        greedy = [r for r in self.requests if r["temperature"] == 0][: a.clients]
        probes = [self.request(r, max_tokens=a.swap_tokens, ignore_eos=True) for r in greedy]
        sampled = [self.request(r, max_tokens=a.swap_tokens) for r in self.requests if r["temperature"] > 0]
        sampled = sampled or [self.request(r, temperature=a.temperature, seed=r["index"]) for r in probes]
        server = self.server(self.head, self.work / f"{a.tune}-swap-log", self.work / f"{a.tune}-swap-server.log", key)
        try:
            before: dict[int, dict] = {}  # the probes answered by the starting head (and one sampled request)
            drive(server.port, probes + sampled[:1], a.clients, lambda req, res: before.update({req["index"]: res}))
            failed = [res for res in before.values() if not res["ok"]]
            if failed:
                raise SystemExit(f"error: a request before the swap failed: {failed[0]['status']} {failed[0]['error']}")
            references = {p["prompt"]: before[p["index"]]["text"] for p in probes}
            started = server.head()
            wave = Wave(server.port, probes, sampled, a.clients)
            swapped = swap_under_traffic(server, str(self.work / a.tune / "head"), key, wave, 1.0, 1800.0)
            result = verdict(swapped, references) | {"head_before": started, "head_after": server.head()}
        finally:
            code = server.stop()
        result |= {"server_exit": code, "answer": swapped["answer"][:300]}
        (self.work / f"{a.tune}-swap.json").write_text(json.dumps(result, indent=1))

    def accept(self) -> None:
        from bench.online_results import measure_acceptance

        a = self.args
        sets = {"heldout": [self.domain[i] for i in self.heldout], "other": self.other}
        heads = {"start": self.head, a.tune: str(self.work / a.tune / "head")}
        measure_acceptance(self.target, heads, sets, self.work / "accept", a.k, a.eval_tokens, a.eval_batch)


def main(argv=None) -> int:
    args = parse_args(argv)
    loop = Loop(args)
    if args.head is None:
        loop.stage("head", loop.work / "demo" / "summary.json", loop.train_head)
    loop.stage("traffic", loop.work / "traffic.done", loop.traffic)
    if not args.train_steps:
        loop.stage("probe", loop.work / "probe.json", loop.probe)
    loop.stage("finetune", loop.work / args.tune / "summary.json", loop.finetune)
    loop.stage("swap", loop.work / f"{args.tune}-swap.json", loop.swap)
    loop.stage("accept", loop.work / "accept" / f"{args.tune}.done", loop.accept)
    data = assemble(loop, command_line("bench.online_loop", argv))
    write_results(data, args.json)
    print(json.dumps(data["rows"], indent=1))
    print(f"[online_loop] results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
