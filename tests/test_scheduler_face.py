"""The scheduler shell's narrow face: the rest of corral asks it with `submit`, `wait`,
`acquire`, `unload` and `no_drafts`, reads it through `view()` (a plain snapshot),
`gpu_contexts()`, `drafter()` and `listen`, and ends it with `begin_drain`, `begin_shutdown`,
`shutdown` and `kill_all`; nothing outside the shell's own modules reads its attributes or
imports its insides. What it works with
(the runner factory, the clock, the hooks) is given at its construction."""

from __future__ import annotations

import ast
import asyncio
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

import corral
from corral.core.spec import Layout, RunnerSpec
from corral.runtime.runner import Runner, RunnerError
from corral.runtime.scheduler import Scheduler, SchedulerConfig, SchedulerError

FACE = {
    "submit", "wait", "acquire", "unload", "no_drafts", "view", "listen", "gpu_contexts",
    "drafter", "begin_drain", "begin_shutdown", "shutdown", "kill_all",
}  # fmt: skip
# The shell and the modules it is made of.
SHELL = {"runtime/scheduler.py", "runtime/measure.py", "runtime/view.py", "runtime/hop.py"}
NAMES = {"scheduler", "sched"}  # what corral's modules call a scheduler
ROOT = Path(corral.__file__).parent


def _is_scheduler(e: ast.expr) -> bool:
    return (isinstance(e, ast.Name) and e.id in NAMES) or (
        isinstance(e, ast.Attribute) and e.attr in NAMES
    )


def _misuses(tree: ast.AST) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_scheduler(node.value):
            if node.attr not in FACE:
                yield node.lineno, f".{node.attr}"
        elif (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "vars")
            and node.args and _is_scheduler(node.args[0])
        ):  # fmt: skip
            yield node.lineno, f"{node.func.id}(...)"
        elif isinstance(node, ast.ImportFrom) and node.module == "corral.runtime.scheduler":
            yield from ((node.lineno, a.name) for a in node.names if a.name.startswith("_"))
        elif isinstance(node, ast.ImportFrom) and node.module == "corral.runtime.measure":
            yield node.lineno, "corral.runtime.measure"


def test_no_module_outside_the_shell_reaches_past_its_face() -> None:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in SHELL:
            continue
        found += [f"{rel}:{n}: {what}" for n, what in _misuses(ast.parse(path.read_text()))]
    assert not found, "\n".join(found)


def test_the_face_is_the_shells_public_methods() -> None:
    assert {n for n in vars(Scheduler) if not n.startswith("_")} == FACE


def test_the_shell_keeps_no_public_attribute() -> None:
    s = Scheduler({"cpu": 2**30}, SchedulerConfig(measure_interval=math.inf))
    assert [n for n in vars(s) if not n.startswith("_")] == []


def test_the_check_sees_a_reader_of_internals() -> None:
    tree = ast.parse(
        "x = self.svc.scheduler.core.runners\n"
        "y = getattr(s.scheduler, 'measured', {})\n"
        "from corral.runtime.scheduler import _ALLOC_FAILED\n"
        "v = sched.view()\n"
    )
    found = [what for _, what in sorted(_misuses(tree))]
    assert found == [".core", "getattr(...)", "_ALLOC_FAILED"]


async def test_what_the_shell_works_with_comes_through_its_constructor(tmp_path: Path) -> None:
    """The runner factory makes every runner and the clock stamps every request; what
    happened is read back through view()."""
    made: list[str] = []

    class Failing(Runner):
        async def start(self, timeout: float) -> None:
            raise RunnerError("no engine here")

    def runners(name: str, spec: RunnerSpec, *, layout: Layout | None) -> Runner:
        made.append(name)
        return Failing(name, spec, layout=layout)

    s = Scheduler(
        {"cpu": 2**30}, SchedulerConfig(measure_interval=math.inf), runners=runners,
        clock=lambda: 1000.0,
    )
    spec = RunnerSpec(path=str(tmp_path / "m.gguf"), n_ctx=512, num_parallel=1)
    try:
        ticket = s.submit("m", spec, size=2**20)
        assert ticket.arrived == 1000.0
        with pytest.raises(SchedulerError, match="no engine here"):
            await s.wait(ticket)
        assert made == ["m"]
        v = s.view()
        assert v.runners == () and [e.kind for e in v.events] == ["load", "load_failed"]
    finally:
        await s.shutdown()


async def test_a_drain_refuses_who_waits_and_abandons_the_load(tmp_path: Path) -> None:
    """begin_drain (SIGTERM): a request waiting for its model's load gets 503 with Retry-After
    at once, the load is abandoned (its runner killed, its booking freed), and new requests
    are refused."""
    loading, killed = asyncio.Event(), asyncio.Event()

    class Held(Runner):  # a load that never ends on its own
        async def start(self, timeout: float) -> None:
            loading.set()
            await killed.wait()
            raise RunnerError("killed")

        def kill_now(self) -> None:
            killed.set()

    s = Scheduler({"cpu": 2**30}, SchedulerConfig(measure_interval=math.inf), runners=Held)
    spec = RunnerSpec(path=str(tmp_path / "m.gguf"), n_ctx=512, num_parallel=1)
    try:
        waiting = asyncio.ensure_future(s.acquire("m", spec, size=2**20))
        await loading.wait()
        assert [r.state for r in s.view().runners] == ["loading"]
        s.begin_drain()
        with pytest.raises(SchedulerError) as e:
            await waiting
        assert (e.value.status, e.value.message) == (503, "server is shutting down")
        assert e.value.retry_after and e.value.retry_after >= 1
        assert killed.is_set()
        for _ in range(100):  # the load's task sees its runner fail, then frees the books
            if not s.view().runners:
                break
            await asyncio.sleep(0.01)
        v = s.view()
        assert v.runners == () and sum(v.booked.values()) == sum(v.reserved.values())
        assert [e.kind for e in v.events] == ["load"]  # abandoned: not a failed load
        with pytest.raises(SchedulerError, match="shutting down"):
            s.submit("m", spec, size=2**20)
    finally:
        await s.shutdown()
