"""Learning per token: our trainer against speculators' P-EAGLE (or DFlash) recipe on the same data.

    python -m bench.learning_efficiency --work DIR --budgets 25000 50000 100000 \
        [--head parallel|dflash] [--seeds 0] [--trainers ours speculators] \
        [--variant NAME='--flag v ...'] [--base NAME] [--json FILE] [--publish [--publish-as NAME]]

One target (Gemma-3-270M), one set of target-regenerated ShareGPT conversations (prepared
under DIR/data by `python -m train --data.prepare_only --data.regenerate`, the settings below),
one feature cache per set of target layers (the target's aux and final-norm states, computed
once and read by both trainers), one sequence order, one draft vocabulary. For each token
budget, trainer, variant and seed a head is trained from scratch on the first sequences of that
order reaching the budget (one sequence per step, its schedule spanning exactly those steps):
- ours: `train.trainer.Trainer` with `python -m train`'s defaults (with `--head dflash`:
  `--model.mode dflash`) plus the variant's flags; a variant with `--data.batch_size B` runs
  ceil(steps / B) steps over the same sequences, one with `--bench.epochs N` makes N passes over
  the sequences of the first budget / N tokens;
- speculators: `bench.speculators_recipe.train_speculators` (their model class, optimizer,
  schedule, COD sampling or anchor choice, and loss as their training CLI builds them for
  `--speculator-type peagle|dflash`), imported by our converter.
Every head is scored by one evaluator, `train.evaluate.HeldoutSet`: simulated acceptance at
K = 7 over the held-out sequences, with its standard error (DFlash heads of every block size
on the same anchors: those leaving room for a block of DFLASH_ROOM). Each run's result is kept
in DIR/runs/NAME/result.json, so a rerun continues where it stopped.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
import types
from pathlib import Path

import numpy as np

from bench.command import command_line

ROOT = Path(__file__).resolve().parent.parent

DATA_FLAGS = ["--data.max_conversations", "320", "--data.heldout", "60", "--data.regenerate", "True"]
DATA_COMMAND = "python -m train --out DIR/data --data.prepare_only True " + " ".join(DATA_FLAGS)
EVAL_K = 7
DFLASH_ROOM = 16  # DFlash anchors scored: those a block of 16 (the largest tried) fits after
HEAD_FLAGS = {"parallel": [], "dflash": ["--model.mode", "dflash"]}


def base_config(target_path: Path, extra: list[str], steps: int):
    from train.flags import parse_args

    flags = ["--model.target", str(target_path), *DATA_FLAGS, "--loop.steps", str(steps)]
    return parse_args([*flags, "--loop.progress", "False", "--eval.enabled", "False", *extra])


class AuxFeatures:
    """What a `FeatureCache` needs of a stepper: the target's states at `aux_ids` (`train.step.target_states`)."""

    def __init__(self, target, aux_ids):
        from train.step import target_states

        self.aux_ids = tuple(int(i) for i in aux_ids)
        self.features = lambda t, p: target_states(target.graphdef, target.state, t, p, self.aux_ids)


class Bench:
    """The shared pieces: target, data, feature caches, sequence order, held-out evaluators."""

    def __init__(self, work: Path, head: str = "parallel"):
        import peagle_jax as pj
        from peagle_jax.sources.assets import prepare
        from train import data as D
        from train.loop import load_data
        from train.trainer import Trainer

        self.work, self.head = work, head
        self.tpath = Path(prepare("gemma3-270m"))
        self.target = pj.load_target(self.tpath, dtype="float32")
        self.cfg = base_config(self.tpath, HEAD_FLAGS[head], 1)
        self.data = load_data(self.cfg, self.target.tokenizer, work / "data", self.target)
        self.counts = D.token_counts(self.data.train, self.target.config.vocab_size)
        probe = Trainer(self.cfg, self.target, 1, token_counts=self.counts)
        self.draft_ids = np.flatnonzero(probe.drafter.t2d)
        self.max_len = self.cfg.data.max_len
        self.seed = self.cfg.data.seed
        self.caches, self.heldout = {}, {}

    def cache(self, aux_ids):
        """The feature cache of the target states at `aux_ids` (DIR/features-A-B-C)."""
        from train.features import FeatureCache

        ids = tuple(int(i) for i in aux_ids)
        if ids not in self.caches:
            folder = self.work / ("features-" + "-".join(map(str, ids)))
            self.caches[ids] = FeatureCache(folder, AuxFeatures(self.target, ids), self.tpath, self.cfg)
        return self.caches[ids]

    def features(self, example, aux_ids):
        n = len(example.ids)
        tokens = np.zeros((1, self.max_len), np.int32)
        positions = np.full((1, self.max_len), -1, np.int32)
        tokens[0, :n], positions[0, :n] = example.ids, np.arange(n)
        batch = types.SimpleNamespace(tokens=tokens, positions=positions)
        aux, y = self.cache(aux_ids).get([example], batch)
        return np.asarray(aux[0]), np.asarray(y[0])

    def order(self, budget: int) -> list[int]:
        """Positions in the training split of the sequences of the first steps reaching `budget` tokens."""
        from train import data as D

        where = {id(e): i for i, e in enumerate(self.data.train)}
        order, tokens = [], 0
        while tokens < budget:
            (e,) = D.batch_examples(self.data.train, len(order), 1, self.seed)
            order.append(where[id(e)])
            tokens += len(e.ids)
        return order

    def evaluator(self, head):
        """The held-out set that scores `head` (a Drafter): one per context layers and block size."""
        from train.evaluate import HeldoutSet

        c = head.config
        block = c.block_size if c.mode == "dflash" else None
        key = (tuple(c.aux_layer_ids), block)
        if key not in self.heldout:
            features = lambda e: self.features(e, key[0])  # noqa: E731
            room = DFLASH_ROOM if block else None
            self.heldout[key] = HeldoutSet(
                self.target, self.data.heldout, features, k=EVAL_K, max_len=self.max_len, block_size=block, room=room
            )
        return self.heldout[key]

    def max_anchors(self) -> int:
        """A bound on the DFlash anchor positions of every training sequence (its supervised
        tokens): speculators pads its anchors to max_anchors (512) and takes them all when a
        sequence has fewer, so this cap changes nothing but the padding it computes."""
        return max(int(np.count_nonzero(e.mask)) for e in self.data.train)


def bench_epochs(flags: list[str]) -> tuple[list[str], int]:
    """(the trainer's flags, N of `--bench.epochs N`: passes over fewer sequences; 1 without it)."""
    if "--bench.epochs" not in flags:
        return flags, 1
    i = flags.index("--bench.epochs")
    return flags[:i] + flags[i + 2 :], int(flags[i + 1])


def train_ours(bench: Bench, order: list[int], flags: list[str], seed: int, out: Path):
    """A head trained on the sequences of `order` (in the trainer's own order: one sequence a step,
    or B a step with --data.batch_size B); with --bench.epochs N, N passes over the first sequences
    of `order` holding a budget / N of its tokens."""
    from train.trainer import Trainer

    flags, epochs = bench_epochs(flags)
    train = bench.data.train
    if epochs > 1:
        tokens = sum(len(train[i].ids) for i in order)
        seen, unique = 0, []
        for i in order:
            if seen >= tokens / epochs:
                break
            unique.append(i)
            seen += len(train[i].ids)
        train = [train[i] for i in sorted(unique)]  # the trainer draws its order over these
    flags = [*HEAD_FLAGS[bench.head], *flags, "--model.seed", str(seed)]
    batch = base_config(bench.tpath, flags, 1).data.batch_size
    steps = -(-len(order) // batch) if epochs == 1 else -(-epochs * len(train) // batch)
    cfg = base_config(bench.tpath, flags, steps)
    trainer = Trainer(cfg, bench.target, steps, token_counts=bench.counts)
    cache = bench.cache(trainer.stepper.aux_ids)
    for e in train:  # computed before the clock starts: train_s counts the steps, as speculators' wall_s does
        bench.features(e, trainer.stepper.aux_ids)
    t0 = time.perf_counter()
    trainer.fit(train, features=cache)
    wall = time.perf_counter() - t0
    head = trainer.head()
    head.save(out / "head")
    return head, wall


def train_theirs(bench: Bench, order: list[int], overrides: dict, seed: int, out: Path):
    from speculators.models.utils import resolve_target_layer_ids

    import peagle_jax as pj
    from bench.speculators_recipe import resolve_config, train_speculators

    examples = [(e.ids, e.mask) for e in bench.data.train]
    kind = "dflash" if bench.head == "dflash" else "peagle"
    if kind == "dflash":  # equal to their 512 on these sequences, without the padded anchors' cost
        overrides = {"max_anchors": bench.max_anchors(), **overrides}
    given = resolve_config(bench.tpath, kind=kind, overrides=overrides).flatten()["target_layer_ids"]
    aux_ids = resolve_target_layer_ids(given, str(bench.tpath))  # theirs: [2, L // 2, L - 3] unless given

    def features(i):
        aux, y = bench.features(bench.data.train[i], aux_ids)
        n = len(bench.data.train[i].ids)
        return aux[:n], y[:n]

    res = train_speculators(
        bench.tpath,
        examples,
        features,
        order,
        bench.draft_ids,
        out / "speculators",
        kind=kind,
        seed=seed,
        overrides=overrides,
        aux_layer_ids=aux_ids,
    )
    return pj.load_drafter(out / "speculators", target=bench.target), res["wall_s"]


def run_one(bench: Bench, trainer: str, variant: str, spec, budget: int, seed: int, base: str | None, command: str):
    name = f"{'dflash-' if bench.head == 'dflash' else ''}{trainer}-{variant}-{budget}-s{seed}"
    out = bench.work / "runs" / name
    done = out / "result.json"
    if done.exists():
        return json.loads(done.read_text())
    order = bench.order(budget)
    tokens = int(sum(len(bench.data.train[i].ids) for i in order))
    print(f"[{name}] {len(order)} steps, {tokens} tokens", flush=True)
    if trainer == "ours":
        head, wall = train_ours(bench, order, spec, seed, out)
    else:
        head, wall = train_theirs(bench, order, spec, seed, out)
    score = bench.evaluator(head).acceptance(head)
    res = {"name": name, "head": bench.head, "trainer": trainer, "variant": variant, "budget": budget, "seed": seed}
    res["base"] = base
    res["command"] = command  # the call that made it, with --work DIR
    res |= {"steps": len(order), "tokens": tokens, "train_s": wall, "heldout": score}
    out.mkdir(parents=True, exist_ok=True)
    done.write_text(json.dumps(res, indent=1))
    print(f"[{name}] acceptance {score['acceptance']:.4f} +- {score['se']:.4f} ({wall:.0f} s)", flush=True)
    return res


def parse_variant(text: str) -> tuple[str, str, object]:
    """'NAME=FLAGS' (ours) or 'speculators:NAME=JSON' (their recipe's overrides)."""
    name, _, rest = text.partition("=")
    if name.startswith("speculators:"):
        return "speculators", name.split(":", 1)[1], json.loads(rest or "{}")
    return "ours", name, shlex.split(rest)


def mean_se(runs: list[dict]) -> tuple[float, float]:
    """Mean held-out acceptance over seeds; its SE from the runs' own (independent) SEs."""
    acc = [r["heldout"]["acceptance"] for r in runs]
    se = [r["heldout"]["se"] for r in runs]
    return float(np.mean(acc)), float(np.sqrt(np.sum(np.square(se))) / len(se))


def group(results: list[dict]) -> dict:
    out: dict = {}
    for r in results:
        out.setdefault((r["trainer"], r["variant"], r["budget"]), []).append(r)
    return out


def comparison_rows(results: list[dict], ours=("adamw", "default")) -> list[list]:
    """Per budget: our recipes `ours` (variant names) and speculators' default side by side."""
    g, rows = group(results), []
    for budget in sorted({r["budget"] for r in results}):
        mine = [g.get(("ours", v, budget)) for v in ours]
        theirs = g.get(("speculators", "default", budget))
        if not theirs or not all(mine):
            continue
        b, sb = mean_se(theirs)
        cells = [f"{a:.3f} ± {sa:.3f}" for a, sa in map(mean_se, mine)]
        ratios = [f"{mean_se(m)[0] / b:.3f}" for m in mine]
        walls = [f"{np.mean([r['train_s'] for r in runs]):.0f}" for runs in (*mine, theirs)]
        rows.append([theirs[0]["tokens"], *cells, f"{b:.3f} ± {sb:.3f}", *ratios, *walls])
    return rows


def baseline_of(trainer: str, variant: str) -> str | None:
    """The run a row is compared with: variants of Muon at lr 1e-3 (muon_*) with that, the other
    levers with AdamW (the previous default), speculators' recipe with our default."""
    if trainer == "speculators":
        return "default"
    if variant == "adamw":
        return None
    return "muon" if variant.startswith("muon_") else "adamw"


def per_round(runs: list[dict]) -> str:
    """The held-out acceptance per greedy round (the engine's walk, `HeldoutSet`) of one seed's run,
    '-' for runs scored before it was recorded."""
    h = runs[0]["heldout"]
    return f"{h['per_round']:.3f} ± {h['per_round_se']:.3f}" if "per_round" in h else "-"


def lever_rows(results: list[dict]) -> list[list]:
    """Per (trainer, variant, budget): held-out acceptance and its difference to its baseline."""
    g, rows = group(results), []
    for (trainer, variant, budget), runs in sorted(g.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1])):
        base_name = baseline_of(trainer, variant) if runs[0].get("base") is None else runs[0]["base"]
        base_name = None if (trainer, base_name) == ("ours", variant) else base_name  # not against itself
        base = g.get(("ours", base_name, budget))
        a, sa = mean_se(runs)
        diff = f"{a - mean_se(base)[0]:+.3f} vs {base_name}" if base else ""
        wall = np.mean([r["train_s"] for r in runs])
        reach = " ".join(f"{x:.2f}" for x in runs[0]["heldout"]["by_depth"][:4])
        cells = [
            budget,
            trainer,
            variant,
            len(runs),
            f"{a:.3f} ± {sa:.3f}",
            diff,
            per_round(runs),
            f"{wall:.0f}",
            reach,
        ]
        rows.append(cells)
    return rows


DATA_SETUP = (
    "Gemma-3-270M; 320 ShareGPT conversations with the target's own greedy answers (`--data.regenerate`, "
    "128 tokens), 256-token sequences: 192 for training (38.5k tokens), 60 held out. Both trainers read the "
    "same cached target features, in the same sequence order, one sequence per step, with the same 16384-token "
    "draft vocabulary."
)
SETUP = {
    "parallel": DATA_SETUP
    + " Held-out acceptance: `train.evaluate.HeldoutSet`, simulated greedy acceptance at K = 7 from every supervised "
    "anchor whose 7 drafts are all supervised, ± its standard error over sequences.",
    "dflash": DATA_SETUP
    + " DFlash heads: ours are `python -m train --model.mode dflash` (1 layer reading target layer 10, block 8, KL, "
    "exp-decay slot weights, Muon) plus the row's flags; speculators' is their `--speculator-type dflash` default "
    "(5 layers reading target layers 2, 9, 15, block 16, cross-entropy, D-PACE, Muon at 1e-3), its max_anchors "
    "capped at the most supervised tokens of a sequence (which takes every anchor, as their 512 does). Held-out "
    "acceptance: `train.evaluate.HeldoutSet`, simulated greedy acceptance of one block's first 7 drafts, from "
    "every anchor whose next 7 tokens are supervised and after which a block of 16 fits, ± its standard error "
    "over sequences.",
}
LEVER_TITLES = {
    "learning_levers": ("Learning levers at equal tokens", 86),
    "dflash_learning": ("DFlash: learning per token, ours against speculators' recipe, and the levers", 88),
}


def publish(results: list[dict], command: str, levers_as: str = "learning_levers", head: str = "parallel") -> None:
    """bench/results/learning_efficiency.json (when DIR holds both trainers' runs) and
    bench/results/LEVERS_AS.json (`python -m bench.render_results`); the commands: the data's, the runs'
    (as they recorded them), then this one."""
    import datetime
    import subprocess

    import jax

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    made = list(dict.fromkeys(r["command"] for r in results if r.get("command")))
    meta = {
        "command": [DATA_COMMAND, *made, command],
        "hardware": "2 shared CPU cores, 23 GB RAM, no accelerator",
        "jax": jax.__version__,
        "commit": commit.strip(),
        "date": datetime.date.today().isoformat(),
        "design": "docs/design/learning-efficiency.md",
    }
    setup = SETUP[head]
    comparison = {
        "title": "Learning per token: ours against speculators' P-EAGLE recipe",
        "order": 85,
        "setup": setup,
        **meta,
        "columns": [
            "tokens",
            "ours: AdamW (previous default)",
            "ours: Muon (default)",
            "speculators 0.9.0",
            "AdamW / speculators",
            "Muon / speculators",
            "AdamW train s",
            "Muon train s",
            "speculators train s",
        ],
        "rows": comparison_rows(results, ours=("adamw", "default")),
        "notes": [],
    }
    title, order = LEVER_TITLES.get(levers_as, ("Learning levers on the default recipe (Muon, lr 2e-3)", 87))
    levers = {
        "title": title,
        "order": order,
        "setup": setup + " Each variant is `python -m train`'s default with the flags named in its row.",
        **meta,
        "columns": [
            "tokens",
            "trainer",
            "variant",
            "seeds",
            "held-out acceptance",
            "vs default",
            "per greedy round",
            "train s",
            "reach depth 0..3",
        ],
        "rows": lever_rows(results),
        "notes": [],
    }
    tables = [("learning_efficiency", comparison)] if comparison["rows"] else []
    for name, table in (*tables, (levers_as, levers)):
        path = ROOT / "bench" / "results" / f"{name}.json"
        if path.exists():  # keep the hand-written notes of an earlier publication
            table["notes"] = json.loads(path.read_text()).get("notes", [])
        path.write_text(json.dumps(table, indent=1) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.learning_efficiency", description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, required=True)
    p.add_argument(
        "--budgets", type=int, nargs="+", help="token budgets (default 25000 50000 100000; none with --publish)"
    )
    p.add_argument("--head", choices=sorted(HEAD_FLAGS), default="parallel", help="P-EAGLE (parallel) or DFlash heads")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--trainers", nargs="+", default=["ours", "speculators"], choices=["ours", "speculators"])
    p.add_argument("--variant", action="append", default=[], help="NAME='--flag v' (ours) or speculators:NAME=JSON")
    p.add_argument("--base", help="the variant every run of this call is compared with (default: by name)")
    p.add_argument("--json", type=Path, help="write every result here")
    p.add_argument("--publish", action="store_true", help="write the tables to bench/results/ (every run in DIR)")
    p.add_argument("--publish-as", default="learning_levers", help="file name (no .json) of the lever table")
    args = p.parse_args(argv)
    runs = [(t, "default", [] if t == "ours" else {}) for t in args.trainers] + [parse_variant(v) for v in args.variant]
    given = list(argv if argv is not None else sys.argv[1:])
    command = command_line("bench.learning_efficiency", [("DIR" if a == str(args.work) else a) for a in given])
    budgets = args.budgets or ([] if args.publish else [25000, 50000, 100000])
    bench = Bench(args.work, args.head) if budgets else None
    results = []
    for budget in budgets:
        for trainer, variant, spec in runs:
            for seed in args.seeds:
                results.append(run_one(bench, trainer, variant, spec, budget, seed, args.base, command))
    if args.json:
        args.json.write_text(json.dumps({"results": results}, indent=1))
    if args.publish:
        every = [json.loads(f.read_text()) for f in sorted((args.work / "runs").glob("*/result.json"))]
        publish([r for r in every if r.get("head", "parallel") == args.head], command, args.publish_as, args.head)
    return 0


if __name__ == "__main__":
    sys.exit(main())
