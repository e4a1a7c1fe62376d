"""How long each command line takes to end after an interrupt during its start-up.

    python -m bench.interrupt_latency [--clis train,infer,convert,plan] [--at 0.5,1,2] [--signals INT,TERM]

Starts each command (run from this tree), sends the signal the given seconds after the start,
and prints the exit status, the seconds from the signal to the exit and the last stderr line.
The commands need no model: train's tiny preset, infer and the converter's inspect on an empty
folder, a plan of a preset target (infer and the converter fail once their imports are done,
about 2 s on an idle machine: a signal after that finds them ended or ending). Run it on the machine as it is (docs/design/cli-probe.md: a busy
2-core machine).
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {
    "train": ["-m", "train", "--preset", "tiny", "--out", "{tmp}/out"],
    "infer": ["-m", "infer", "generate", "--target", "{tmp}", "--prompt-ids", "1,2", "--mode", "none"],
    "convert": ["-m", "peagle_jax.formats.convert", "inspect", "{tmp}"],
    "plan": ["-m", "peagle_jax.plan", "--target", "Llama-3.1-8B", "--device", "h100"],
}


def measure(cli: str, sig: signal.Signals, at: float) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, *(a.format(tmp=tmp) for a in COMMANDS[cli])]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(at)
        if proc.poll() is not None:
            return f"{cli} SIG{sig.name[3:]} at {at:.1f} s: ended before the signal (exit {proc.returncode})"
        sent = time.monotonic()
        proc.send_signal(sig)
        _, err = proc.communicate()
        took = time.monotonic() - sent
    last = (err.strip().splitlines() or [""])[-1]
    return f"{cli} {sig.name} at {at:.1f} s: exit {proc.returncode} {took:.2f} s after the signal | {last[:120]}"


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.interrupt_latency", description=__doc__.split("\n")[0])
    p.add_argument("--clis", default=",".join(COMMANDS), help="comma-separated: " + ", ".join(COMMANDS))
    p.add_argument("--at", default="0.5,1,2", help="seconds after the start, comma-separated")
    p.add_argument("--signals", default="INT,TERM", help="INT, TERM or both")
    args = p.parse_args()
    for cli in args.clis.split(","):
        for name in args.signals.split(","):
            for at in (float(x) for x in args.at.split(",")):
                print(measure(cli, signal.Signals[f"SIG{name}"], at), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
