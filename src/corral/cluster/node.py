"""A node's corral, as its agent starts it: `python -m corral.cluster.node`.

Today's single-node `corral serve` (settings from the environment the agent gives it), tied to
the agent's life: it is SIGKILLed the moment the agent's worker process dies (PR_SET_PDEATHSIG,
and a watch on the parent pid for the cases prctl misses, such as the forking thread ending).
Its runners die with it (their own PR_SET_PDEATHSIG), so a node whose agent or raylet is killed
leaves no runner behind and its streams break at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1


def die_with(parent: int) -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.5)

    if os.getppid() != parent:
        os._exit(1)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main() -> None:
    parent = int(os.environ.get("CORRAL_AGENT_PID", "0")) or os.getppid()
    die_with(parent)
    from corral.server import serve

    serve()


if __name__ == "__main__":
    main()
