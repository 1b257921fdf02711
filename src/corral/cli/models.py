"""`corral list / show / ps / stop / version`: the models on disk and in memory; `corral pull /
create / cp / rm`: getting and managing them."""

from __future__ import annotations

import argparse
import hashlib
import itertools
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.cells import cell_len
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from corral import __version__
from corral.cli import modelfile
from corral.cli.client import Client, CLIError, Unreachable, connect
from corral.cli.display import (
    _head,
    _int,
    _number,
    human_bytes,
    human_duration,
    human_number,
    human_time,
    parse_time,
    print_table,
    processor,
    short_id,
    until_text,
)


def ps_rows(models: Sequence[Mapping[str, Any]], now: datetime | None = None) -> list[list[str]]:
    """NAME, ID, SIZE, PROCESSOR, CONTEXT, UNTIL rows from /api/ps models."""
    rows = []
    for m in models:
        size, vram = _int(m.get("size")), _int(m.get("size_vram"))
        context = m.get("context_length")
        rows.append(
            [
                str(m.get("name") or m.get("model") or ""),
                short_id(m.get("digest")),
                human_bytes(size),
                processor(size, vram),
                str(context) if context is not None else "-",
                until_text(parse_time(m.get("expires_at")), now),
            ]
        )
    return rows


def rate_text(m: Mapping[str, Any]) -> str:
    """The TOKENS/S column of `ps`: the generated tokens per second corral relays from the
    model's runner now, and each busy slot's when more than one is: `23.1 (12.0+11.1)`."""
    rate = m.get("tokens_per_second")
    if not isinstance(rate, (int, float)):
        return "-"
    slots = [x for x in m.get("slot_tokens_per_second") or () if isinstance(x, (int, float)) and x]
    text = f"{rate:.1f}"
    if len(slots) > 1:
        text += " (" + "+".join(f"{x:.1f}" for x in slots) + ")"
    return text


def slots_text(m: Mapping[str, Any]) -> str:
    """A runner's slots in use / its slots ("2/4"), from corral's own /api/ps fields."""
    if "num_parallel" not in m:
        return "-"
    return f"{_int(m.get('requests_in_flight'))}/{_int(m.get('num_parallel'))}"


def drafting_lines(models: Sequence[Mapping[str, Any]]) -> list[str]:
    """`ps --verbose`: how each model's runner drafts (speculative decoding), and what auto
    chose and why (corral's own /api/ps fields)."""
    lines = []
    for m in models:
        drafter, why = m.get("speculative"), m.get("drafting")
        if drafter is None and why is None:
            continue
        name = str(m.get("name") or m.get("model") or "")
        text = f"{name}: drafts with {drafter}" if drafter != "off" else f"{name}: no drafting"
        lines.append(text + (f" (auto, {why})" if why else ""))
    return lines


def queue_text(m: Mapping[str, Any]) -> str:
    """The QUEUE column of `ps`: the requests queued for the model's runner, and of those it
    serves, the ones waiting for room in its shared context ("2 queued, 1 for room")."""
    parts = []
    if queued := _int(m.get("queued")):
        parts.append(f"{queued} queued")
    if room := _int(m.get("waiting_for_room")):
        parts.append(f"{room} for room")
    return ", ".join(parts) or "-"


def unloaded_waiting_rows(
    waiting: Sequence[Mapping[str, Any]], shown: set[str]
) -> list[list[str]]:
    """WAITING FOR, REQUESTS, LONGEST, WHY rows from /api/corral/books' `waiting`: per model
    with no runner in `ps` (its load waits), how many wait, the longest wait, and why the
    first waits."""
    by_model: dict[str, list[Mapping[str, Any]]] = {}
    for w in waiting:
        model = str(w.get("model") or "")
        if model and model not in shown:
            by_model.setdefault(model, []).append(w)
    return [
        [model, str(len(ws)),
         human_duration(max(float(w.get("waited") or 0) for w in ws)),
         str(ws[0].get("reason") or ws[0].get("why") or "")]
        for model, ws in by_model.items()
    ]  # fmt: skip


def list_rows(models: Sequence[Mapping[str, Any]], now: datetime | None = None) -> list[list[str]]:
    """NAME, ID, SIZE, MODIFIED rows from /api/tags models."""
    return [
        [
            str(m.get("name") or m.get("model") or ""),
            short_id(m.get("digest")),
            human_bytes(_int(m.get("size"))),
            human_time(parse_time(m.get("modified_at")), now),
        ]
        for m in models
    ]


def format_show(info: Mapping[str, Any]) -> str:
    """Ollama's `show` summary: Model, Capabilities, Parameters, System and License sections."""
    details: Mapping[str, Any] = info.get("details") or {}
    model_info: Mapping[str, Any] = info.get("model_info") or {}
    model: list[list[str]] = []
    if model_info:
        arch = str(model_info.get("general.architecture") or details.get("family") or "")
        params = details.get("parameter_size") or ""
        if not params and "general.parameter_count" in model_info:
            params = human_number(_int(model_info["general.parameter_count"]))
        model += [["architecture", arch], ["parameters", str(params)]]
        for key, label in (
            ("context_length", "context length"),
            ("embedding_length", "embedding length"),
        ):
            if f"{arch}.{key}" in model_info:
                model.append([label, _number(model_info[f"{arch}.{key}"])])
    else:
        model += [
            ["architecture", str(details.get("family") or "")],
            ["parameters", str(details.get("parameter_size") or "")],
        ]
    model.append(["quantization", str(details.get("quantization_level") or "")])

    sections: list[tuple[str, list[list[str]]]] = [("Model", model)]
    if caps := info.get("capabilities"):
        sections.append(("Capabilities", [[str(c)] for c in caps]))
    if params_text := info.get("parameters"):
        # "stop  "<|im_end|>"" lines: the name, then the value (which may hold spaces)
        rows = [line.split(None, 1) for line in str(params_text).splitlines() if line.strip()]
        sections.append(("Parameters", rows))
    for key, title in (("system", "System"), ("license", "License")):
        if text := info.get(key):
            sections.append((title, [[line] for line in _head(str(text), 2)]))

    out: list[str] = []
    for title, rows in sections:
        out.append(f"  {title}")
        widths: dict[int, int] = {}
        for row in rows:
            for i, cell in enumerate(row[:-1]):
                widths[i] = max(widths.get(i, 0), cell_len(cell))
        for row in rows:
            cells = [c + " " * (widths[i] - cell_len(c)) for i, c in enumerate(row[:-1])]
            out.append("    " + "    ".join([*cells, row[-1]]).rstrip())
        out.append("")
    return "\n".join(out)


def cmd_ps(args: argparse.Namespace) -> int:
    with connect() as client:
        data = client.get("/api/ps")
        try:  # corral's own: who waits, models not loaded yet included
            waiting = client.get("/api/corral/books").get("waiting") or []
        except CLIError:  # an Ollama server, or a corral from before the list
            waiting = []
    models = data.get("models") or []
    headers = ["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"]
    rows = ps_rows(models)
    if any("tokens_per_second" in m for m in models):  # corral's: what it relays now
        headers.append("TOKENS/S")
        rows = [[*row, rate_text(m)] for row, m in zip(rows, models, strict=True)]
    if any("num_parallel" in m for m in models):  # corral's own: slots in use / slots
        headers.append("SLOTS")
        rows = [[*row, slots_text(m)] for row, m in zip(rows, models, strict=True)]
    if any(_int(m.get("queued")) or _int(m.get("waiting_for_room")) for m in models):
        headers.append("QUEUE")  # only while something waits, as Ollama shows none
        rows = [[*row, queue_text(m)] for row, m in zip(rows, models, strict=True)]
    if any(len(m.get("models") or ()) > 1 for m in models):  # one runner, several names
        headers.append("ALSO SERVES")
        rows = [[*row, ", ".join((m.get("models") or [])[1:]) or "-"]
                for row, m in zip(rows, models, strict=True)]  # fmt: skip
    if any("node" in m for m in models):  # a cluster's entry (corral serve --ray)
        headers.append("NODE")
        rows = [[*row, str(m.get("node", ""))] for row, m in zip(rows, models, strict=True)]
    print_table(headers, rows)
    if getattr(args, "verbose", False) and (lines := drafting_lines(models)):
        print()
        print("\n".join(lines))
    shown = {str(m.get("name") or m.get("model") or "") for m in models}
    if more := unloaded_waiting_rows(waiting, shown):  # requests for models not loaded yet
        print()
        print_table(["WAITING FOR", "REQUESTS", "LONGEST", "WHY"], more)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    with connect() as client:
        data = client.get("/api/tags")
    models = data.get("models") or []
    print_table(["NAME", "ID", "SIZE", "MODIFIED"], list_rows(models))
    for m in models:  # a file the server cannot use, and why (Ollama lists no such thing)
        if m.get("error"):
            print(f"{m.get('name')} is unusable: {m['error']}")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    with connect() as client:
        for _ in client.stream("/api/generate", {"model": args.model, "keep_alive": 0}):
            pass
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    with connect() as client:
        info = client.post("/api/show", {"model": args.model})
    if args.field:
        text = str(info.get(args.field) or "")
        sys.stdout.write(text if text.endswith("\n") or not text else text + "\n")
    else:
        sys.stdout.write(format_show(info) + "\n")
    return 0


def cmd_version(args: argparse.Namespace) -> int:
    print(f"corral client version {__version__}")
    try:
        with connect() as client:
            answer = client.get("/api/version")
        server = answer.get("corral") or answer.get("version", "unknown")
    except Unreachable as e:
        print(f"Warning: {e}", file=sys.stderr)
    except CLIError as e:
        print(f"Warning: could not get the server version: {e}", file=sys.stderr)
    else:
        print(f"corral server version {server}")
        if "corral" in answer:
            print(f"Ollama API version {answer['version']}")
    return 0


# ---- getting and managing models: pull / create / cp / rm ------------------------------------
def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
    )


def show_progress(chunks: Iterable[Mapping[str, Any]]) -> None:
    """Ollama's progress lines: a bar per file (`digest` with `total`), other statuses as text.
    Nothing is drawn until the first line is in: a request refused at once leaves no trace."""
    lines = iter(chunks)
    first = next(lines, None)
    if first is None:
        return
    with _progress() as bar:
        tasks: dict[str, TaskID] = {}
        for chunk in itertools.chain([first], lines):
            status = str(chunk.get("status", ""))
            digest, total = chunk.get("digest"), chunk.get("total")
            if digest and total:
                if digest not in tasks:
                    tasks[digest] = bar.add_task(status, total=int(total))
                bar.update(tasks[digest], completed=int(chunk.get("completed") or 0))
            elif status:
                bar.console.print(status)


def cmd_pull(args: argparse.Namespace) -> int:
    with connect() as client:
        show_progress(client.stream("/api/pull", {"model": args.model, "stream": True}))
    return 0


def upload_blob(client: Client, path: Path) -> str:
    """Upload a file as a blob unless the server has it; its digest."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    digest = f"sha256:{h.hexdigest()}"
    if client.send("HEAD", f"/api/blobs/{digest}", ok=(404,)).status_code == 404:
        with _progress() as bar:
            task = bar.add_task(f"copying {path.name}", total=path.stat().st_size)

            def chunks() -> Iterator[bytes]:
                with open(path, "rb") as f:
                    while block := f.read(1 << 20):
                        bar.advance(task, len(block))
                        yield block

            client.send("POST", f"/api/blobs/{digest}", content=chunks())
    return digest


def cmd_create(args: argparse.Namespace) -> int:
    path = Path(args.file or "Modelfile")
    try:
        text = path.read_text()
    except OSError as e:
        raise CLIError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        parsed = modelfile.parse(text, path.resolve().parent)
    except modelfile.ModelfileError as e:
        raise CLIError(f"{path}: {e}") from None
    body: dict[str, Any] = {"model": args.model, **parsed.body, "stream": True}
    if args.quantize:
        body["quantize"] = args.quantize
    with connect() as client:
        if parsed.files:
            body["files"] = {p.name: upload_blob(client, p) for p in parsed.files}
        if parsed.adapters:
            body["adapters"] = {p.name: upload_blob(client, p) for p in parsed.adapters}
        show_progress(client.stream("/api/create", body))
    return 0


def cmd_cp(args: argparse.Namespace) -> int:
    with connect() as client:
        client.send("POST", "/api/copy", {"source": args.source, "destination": args.destination})
    print(f"copied '{args.source}' to '{args.destination}'")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    with connect() as client:
        for name in args.models:
            resp = client.send("DELETE", "/api/delete", {"model": name})
            print(f"deleted '{name}'")
            try:  # corral says what it removed (Ollama's answer is empty)
                info = resp.json()
            except ValueError:
                continue
            if isinstance(info, dict):
                for p in info.get("removed") or []:
                    print(f"  removed {p}")
                for p in info.get("kept") or []:
                    print(f"  kept {p} (not corral's)")
    return 0
