"""The stage records (WORK/stages/NAME.json) and the stages that run the trainer as a subprocess
(`python -m train`): data and the training of each head."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from peagle_jax.runtime.folders import atomic_write_text
from report.common import dflash_block_size, log


class Stages:
    """WORK/stages/NAME.json: what a finished stage made, with the settings it was made with."""

    def __init__(self, work: Path):
        self.folder = work / "stages"

    def path(self, name: str) -> Path:
        return self.folder / f"{name}.json"

    def reuse(self, name: str, settings: dict, derived: dict | None = None) -> dict | None:
        """The record of a finished stage (None: not finished, or stale). Made with other
        `settings` (flags): an error naming the flag. Made with other `derived` settings (what the
        report chooses itself, such as the heads compared): stale, so the stage is redone."""
        path = self.path(name)
        if not path.exists():
            return None
        record = json.loads(path.read_text())
        for flag, value in settings.items():
            old = record["settings"].get(flag)
            if old != value:
                raise ValueError(
                    f"{flag}: stage {name} in {path.parent.parent} was made with {flag} {old} (now {value}): "
                    f"use another --work, or delete {path} to redo the stage"
                )
        for key, value in (derived or {}).items():
            old = record["settings"].get(key)
            if old != value:
                log(f"stage {name}: made with {key} {old} (now {value}): redoing it")
                return None
        log(f"stage {name}: reused ({path})")
        return record

    def finish(self, name: str, settings: dict, seconds: float, **data) -> dict:
        record = {"stage": name, "settings": settings, "seconds": seconds, **data}
        atomic_write_text(self.path(name), json.dumps(record, indent=1))
        log(f"stage {name}: done in {seconds:.1f} s")
        return record


# ShareGPT records per training step: about a fifth of the records have no supervised answer or
# are malformed (the report's 224 gave 178 examples), and a step past one epoch trains on seen
# conversations, whose simulated acceptance overstates the head's (docs/design/acceptance-prediction.md)
COVER = 1.4


def trainer_command(args, out: Path, mode: str, steps: int, target: str) -> list[str]:
    cmd = [sys.executable, "-m", "train", *args.train_flags]
    cmd += ["--out", str(out), "--model.target", target, "--model.mode", mode, "--loop.steps", str(steps)]
    if mode == "dflash":  # one block drafts every K evaluated
        cmd += ["--model.block_size", str(dflash_block_size(args.ks))]
    cmd += ["--data.batch_size", str(args.batch_size), "--data.heldout", str(args.heldout)]
    if args.regenerate:  # the conversations the steps use (+ held out), each regenerated once
        conversations = round(COVER * args.steps * args.batch_size) + args.heldout
        cmd += ["--data.regenerate", "True", "--data.max_conversations", str(conversations)]
        cmd += ["--data.regenerate_tokens", str(args.regenerate_tokens)]
    return cmd + ["--eval.enabled", "False", "--loop.progress", "False"]


def shown(cmd: list[str]) -> str:
    """The command as a user would type it: `python`, paths under the working directory relative
    to it and paths under the home folder as ~/... (the report names no machine's folders)."""
    args = ["python", *cmd[1:]] if cmd and cmd[0] == sys.executable else cmd
    return " ".join(shlex.quote(a) if not a.startswith("~/") else a for a in map(_portable, args))


def _portable(arg: str) -> str:
    if not arg.startswith("/"):
        return arg
    path = Path(arg)
    for base, shown_as in ((Path.cwd(), None), (Path.home(), "~")):
        if path.is_relative_to(base):
            rel = path.relative_to(base)
            return str(rel) if shown_as is None else f"{shown_as}/{rel}"
    return arg


def run_trainer(cmd: list[str], logfile: Path) -> dict:
    """Runs `python -m train` (its output in `logfile`); its OUT/summary.json."""
    logfile.parent.mkdir(parents=True, exist_ok=True)
    log(f"running {shown(cmd)} (log: {logfile})")
    with logfile.open("a") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        try:
            code = proc.wait()
        except BaseException:  # interrupted: stop the trainer too (it resumes from its checkpoint)
            proc.terminate()
            proc.wait()
            raise
    if code != 0:
        errors = [ln for ln in logfile.read_text().splitlines() if ln.startswith("error:")]
        why = errors[-1] if errors else f"exit status {code}"
        raise RuntimeError(f"python -m train failed ({why}); see {logfile}")
    out = Path(cmd[cmd.index("--out") + 1])
    return json.loads((out / "summary.json").read_text())


def stage_data(args, stages: Stages, work: Path) -> dict:
    settings = {"--smoke": args.smoke, "--target": args.target, "--regenerate": args.regenerate}
    if args.regenerate:
        settings["--budget"] = args.budget
    record = stages.reuse("data", settings)
    if record is not None:
        return record
    t0 = time.perf_counter()
    cmd = trainer_command(args, work / "data", "parallel", 1, args.target) + ["--data.prepare_only", "true"]
    summary = run_trainer(cmd, work / "logs" / "data.log")
    regenerated = work / "data" / "regenerated.jsonl"
    return stages.finish(
        "data",
        settings,
        time.perf_counter() - t0,
        commands=[shown(cmd)],
        target=summary["target"],
        data=summary["data"],
        regenerated=str(regenerated) if args.regenerate else None,
    )


def train_settings(args, mode: str | None = None) -> dict:
    """The flags a head's training depends on; DFlash's block size comes from --ks (max K + 1).
    P-EAGLE and EAGLE-3 keep the settings of a two-head run, so its trained heads are reused."""
    settings = {
        "--smoke": args.smoke,
        "--target": args.target,
        "--regenerate": args.regenerate,
        "--budget": args.budget,
    }
    if mode == "dflash":
        settings["--ks"] = args.ks
    return settings


def eval_settings(args) -> dict:
    return {
        **train_settings(args),
        "--prompts-per-set": args.prompts_per_set,
        "--max-new-tokens": args.max_new_tokens,
        "--max-prompt-tokens": args.max_prompt_tokens,
        "--ks": args.ks,
    }


def stage_train(args, stages: Stages, work: Path, data: dict, mode: str) -> dict:
    name = f"train-{mode}"
    settings = train_settings(args, mode)
    record = stages.reuse(name, settings)
    if record is not None:
        return record
    t0 = time.perf_counter()
    out = work / "heads" / mode
    if data["regenerated"]:  # the answers of stage data: the trainer finds them all done
        out.mkdir(parents=True, exist_ok=True)
        if not (out / "regenerated.jsonl").exists():
            tmp = out / "regenerated.jsonl.tmp"
            shutil.copyfile(data["regenerated"], tmp)
            os.replace(tmp, out / "regenerated.jsonl")
    cmd = trainer_command(args, out, mode, args.steps, data["target"])
    summary = run_trainer(cmd, work / "logs" / f"{name}.log")
    return stages.finish(name, settings, time.perf_counter() - t0, commands=[shown(cmd)], summary=summary)
