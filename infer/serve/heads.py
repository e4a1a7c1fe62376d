"""The head a server drafts with, and swapping it without a restart.

`POST /v1/admin/head {"path": DIR}` (with `--admin-key`) or SIGHUP (re-reading `--drafter`): the
new head is loaded and checked off the device loop (a worker thread: `Engine.with_drafter` refuses
a head whose network differs, naming what), then the device loop takes it between two turns
(`Scheduler.swap`): the compiled programs run it as they are, no request is dropped, and every
stream stays lossless (a request's drafts only decide how many of the target's tokens a round
gains). One swap at a time. `/v1/models` and the metrics name the head in use: its folder's name
and a content hash of its weights.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from pathlib import Path

from infer.load import load_head

log = logging.getLogger("infer.serve")


@dataclasses.dataclass(frozen=True)
class HeadIdentity:
    name: str  # the head's folder name (never a path), or its Hub id / `new:LAYERS` as given
    fingerprint: str  # `Drafter.fingerprint()`: a content hash of its weights

    def card(self) -> dict:
        return {"name": self.name, "fingerprint": self.fingerprint}


def identity(spec: str, drafter) -> HeadIdentity:
    path = Path(str(spec))
    return HeadIdentity(path.resolve().name if path.is_dir() else str(spec), drafter.fingerprint())


class Heads:
    """The served head and its swaps (`swap` from a worker thread: it blocks until the device loop
    has taken the new head)."""

    def __init__(self, scheduler, mode: str, spec: str, drafter, swappable: bool = True):
        self.scheduler, self.mode, self.swappable = scheduler, mode, swappable
        self.current = identity(spec, drafter)
        self._one = threading.Lock()
        scheduler.metrics.head(self.current.name, self.current.fingerprint)

    def swap(self, spec: str) -> HeadIdentity:
        """Loads the head at `spec`, checks it against the served network (ValueError naming what
        differs), and serves it from the next turn on."""
        if not self.swappable:
            raise ValueError(
                "a server across hosts changes its head by a restart with --drafter (every process loads it)"
            )
        with self._one:
            drafter = load_head(spec, self.scheduler.slots.engine.target, self.mode)
            engine = self.scheduler.slots.engine.with_drafter(drafter)
            new = identity(spec, drafter)
            self.scheduler.swap(engine)
            log.warning("serving the head %s (%s), was %s (%s)", new.name, new.fingerprint, *self._was())
            self.current = new
            self.scheduler.metrics.head(new.name, new.fingerprint)
            return new

    def _was(self) -> tuple[str, str]:
        return self.current.name, self.current.fingerprint

    def reload(self, spec: str) -> None:
        """SIGHUP: swap to `spec` again in a thread of its own; one log line either way."""

        def run():
            try:
                self.swap(spec)
            except Exception as err:  # noqa: BLE001 - a refused head is one line, the server goes on
                log.error("the head at %s was not swapped in: %s", spec, " ".join(str(err).split())[:300])

        threading.Thread(target=run, name="head-reload", daemon=True).start()
