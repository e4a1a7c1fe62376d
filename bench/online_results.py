"""`bench.online_loop`'s measurements and its results file: acceptance length of each head on each
prompt set (in process, `SpeculativeDecoder.generate`, greedy), and the table assembled from what the
stages left in the work folder."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path

import jax

ROOT = Path(__file__).resolve().parent.parent
GOALS = {"heldout": 0.15, "other": -0.03}  # acceptance length gained in domain; lost at most elsewhere


def measure_acceptance(target: str, heads: dict, sets: dict, folder: Path, k: int, tokens: int, batch: int) -> None:
    """FOLDER/HEAD-SET.json for every head and prompt set not measured yet: acceptance length at
    `k` (greedy, `tokens` new tokens per prompt, `batch` prompts a call) and the tokens answered;
    then FOLDER/HEAD.done for each head."""
    import peagle_jax as pj
    from infer import SpeculativeDecoder

    folder.mkdir(parents=True, exist_ok=True)
    todo = [(h, s) for h in heads for s in sets if not (folder / f"{h}-{s}.json").exists()]
    model = pj.load_target(target, dtype="float32") if todo else None
    for head, name in todo:
        decoder = SpeculativeDecoder(model, pj.load_drafter(heads[head]), k=k)
        prompts, weighted, rounds, answers = sets[name], 0.0, 0, []
        for i in range(0, len(prompts), batch):
            res = decoder.generate(prompts[i : i + batch], max_new_tokens=tokens)
            weighted += res.stats["acceptance_length"] * res.stats["rounds"]
            rounds += res.stats["rounds"]
            answers += res.tokens
        result = {"acceptance_length": weighted / max(rounds, 1), "rounds": rounds, "prompts": len(prompts)}
        result |= {"k": k, "max_new_tokens": tokens, "tokens": answers}
        (folder / f"{head}-{name}.json").write_text(json.dumps(result))
        print(f"[online_loop] acceptance of {head} on {name}: {result['acceptance_length']:.3f}", flush=True)
    for head in heads:
        (folder / f"{head}.done").write_text("")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def traffic_summary(loop) -> dict:
    """What the clients got (WORK/traffic.jsonl) and what the server logged (WORK/log)."""
    from peagle_jax.conversations.request_log import read_requests

    answers = read_jsonl(loop.work / "traffic.jsonl")
    logged = read_requests(loop.work / "log")
    heldout = [loop.domain[i] for i in loop.heldout]
    return {
        "requests": len(loop.requests),
        "answered": sum(a["ok"] for a in answers),
        "failed": sum(not a["ok"] for a in answers),
        "greedy": sum(a["temperature"] == 0 for a in answers),
        "completion_tokens": sum(a["tokens"] for a in answers),
        "seconds": sum(r["seconds"] for r in read_jsonl(loop.work / "traffic-runs.jsonl")),
        "logged": len(logged),
        "heldout_prompts_logged": sum(r.messages in heldout for r in logged if r.messages is not None),
        "served_prompts": len(loop.served),
        "heldout_prompts": len(loop.heldout),
    }


def finetune_summary(loop) -> dict:
    a = loop.args
    summary = json.loads((loop.work / a.tune / "summary.json").read_text())
    probe = loop.work / "probe.json"
    return {
        "command": (loop.work / f"{a.tune}.command").read_text().strip() if not a.train_steps else None,
        "step_seconds_probe": json.loads(probe.read_text())["step_seconds"] if probe.exists() else None,
        "steps": summary["steps"],
        "planned_steps": loop.steps(),
        "train_seconds": summary["train_seconds"],
        "budget_seconds": 60 * a.train_minutes,
        "stopped_early": summary["stopped_early"],
        "train_tokens": summary["train_tokens"],
        "request_log": summary["data"].get("request_log"),
        "heldout_rounds": summary.get("heldout_rounds"),
    }


def acceptance_summary(loop) -> dict:
    """{set: {"start", "tuned", "change", "prompts", "identical"}}: identical counts the prompts both
    heads answered with the same tokens (greedy: the target's, whoever drafts)."""
    out = {}
    for name in ("heldout", "other"):
        start, tuned = (
            json.loads((loop.work / "accept" / f"{h}-{name}.json").read_text()) for h in ("start", loop.args.tune)
        )
        out[name] = {
            "start": start["acceptance_length"],
            "tuned": tuned["acceptance_length"],
            "change": tuned["acceptance_length"] - start["acceptance_length"],
            "prompts": start["prompts"],
            "identical": sum(a == b for a, b in zip(start["tokens"], tuned["tokens"])),
        }
    return out


def met(ok: bool) -> str:
    return "yes" if ok else "no"


def rows(loop, traffic: dict, tune: dict, swap: dict, accept: dict) -> list[list]:
    domain, other = loop.names
    f = "{:.3f}".format
    h, o = accept["heldout"], accept["other"]
    across, wave = swap["across_swap"], swap["wave"]
    budget = f"{tune['train_seconds'] / 60:.1f} min, {tune['steps']} steps"
    return [
        [f"{domain} held out ({h['prompts']} prompts never sent): acceptance length, K={loop.args.k}",
         f"{f(h['start'])} -> {f(h['tuned'])} ({h['change']:+.3f})", f">= +{GOALS['heldout']:.2f}",
         met(h["change"] >= GOALS["heldout"])],
        [f"{other} ({o['prompts']} prompts): acceptance length, K={loop.args.k}",
         f"{f(o['start'])} -> {f(o['tuned'])} ({o['change']:+.3f})", f">= {GOALS['other']:+.2f}",
         met(o["change"] >= GOALS["other"])],
        [f"the swap: requests dropped / greedy changed, of {across['requests']} in flight across it "
         f"({across['greedy']} greedy)", f"{across['dropped']} / {across['changed']}", "0 / 0",
         met(across["dropped"] == across["changed"] == 0)],
        [f"the swap's traffic: dropped / greedy changed, of {wave['requests']} ({wave['greedy']} greedy)",
         f"{wave['dropped']} / {wave['changed']}", "0 / 0", met(wave["dropped"] == wave["changed"] == 0)],
        ["the swap: programs compiled (from the swap to the end of its traffic)", str(swap["compiles"]), "0",
         met(swap["compiles"] == 0)],
        ["traffic: requests answered / failed / logged", f"{traffic['answered']} / {traffic['failed']} / "
         f"{traffic['logged']}", "", ""],
        ["fine-tune: examples from the log (requests read, duplicates dropped)",
         f"{tune['request_log']['used']} ({tune['request_log']['requests']}, {tune['request_log']['duplicates']})",
         "", ""],
        [f"fine-tune: training time, steps (budget {tune['budget_seconds'] / 60:g} min)", budget, "", ""],
    ]  # fmt: skip


def stage_seconds(work: Path) -> dict:
    out: dict[str, float] = {}
    for rec in read_jsonl(work / "stages.jsonl"):
        out[rec["stage"]] = out.get(rec["stage"], 0.0) + rec["seconds"]
    return out


def assemble(loop, command: str) -> dict:
    """The results file's content (bench/render_results' keys, and "raw": every figure)."""
    a = loop.args
    traffic, tune, accept = traffic_summary(loop), finetune_summary(loop), acceptance_summary(loop)
    swap = json.loads((loop.work / f"{a.tune}-swap.json").read_text())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    domain, other = loop.names
    target = "the tiny preset target (a smoke run)" if a.smoke else "Gemma-3-270M (float32)"
    return {
        "title": f"Learning from traffic: serve, log, fine-tune, swap ({domain}, {target})",
        "order": 62,
        "setup": f"{target}, K={a.k}. The starting head: {'the demo head (make demo)' if a.head is None else a.head}. "
        f"{domain}'s {len(loop.domain)} prompts split by a seeded shuffle: {len(loop.served)} served, "
        f"{len(loop.heldout)} held out and never sent. {a.requests} streaming chat requests from {a.clients} "
        f"clients (each served prompt first greedy, then at temperature {a.temperature} with seeds; max_tokens "
        f"{a.max_tokens}) through `python -m infer serve --log-requests --admin-key`; the head fine-tuned on the "
        f"log (`python -m train --data.source LOG --model.init_head HEAD`) for the steps {a.train_minutes:g} "
        f"minutes hold at the step time a probe measured; swapped in through `POST /v1/admin/head` while "
        f"{a.clients} clients stream ({a.swap_tokens} tokens a request, greedy ones checked against the same "
        f"requests answered before the swap); acceptance length measured greedy ({a.eval_tokens} new tokens a "
        f"prompt) on the held-out prompts and on {other}.",
        "command": command,
        "hardware": f"{platform.machine()}, {os.cpu_count()} cores, no accelerator; shared with other jobs",
        "jax": jax.__version__,
        "commit": commit.stdout.strip(),
        "date": datetime.date.today().isoformat(),
        "columns": ["measure", "value", "goal", "met"],
        "rows": rows(loop, traffic, tune, swap, accept),
        "notes": notes(tune, accept),
        "raw": {
            "traffic": traffic,
            "finetune": tune,
            "swap": swap,
            "acceptance": accept,
            "stage_seconds": stage_seconds(loop.work),
        },  # fmt: skip
    }


def notes(tune: dict, accept: dict) -> list[str]:
    h, o = accept["heldout"], accept["other"]
    out = [
        f"The fine-tune: `{tune['command']}`" if tune["command"] else "The fine-tune ran a fixed number of steps.",
        f"Greedy answers identical under both heads (lossless): {h['identical']} of {h['prompts']} held out, "
        f"{o['identical']} of {o['prompts']} elsewhere.",
    ]
    if tune["stopped_early"]:
        out.append(f"The fine-tune stopped at its time cap after {tune['steps']} of {tune['planned_steps']} steps.")
    return out


def write_results(data: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
