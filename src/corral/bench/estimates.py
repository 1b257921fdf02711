"""Memory estimates against what llama.cpp really allocates.

For every model the test suite makes or ships (synthetic llama at three sizes and with the full
vocabulary, gemma3 with sliding-window layers, bert for embeddings, a mixture of experts, the
real SmolLM2), at several contexts, parallel slots (on a KV cache per slot, and on one unified
cache the slots share) and KV cache types: load the model in a real
runner, read llama.cpp's own account of its buffers (Runner.allocation) and compare it with
corral.core.estimate. Models with parts are measured too: synthetic vision projectors (a tiny
one and a ViT-B-sized one) and LoRA adapters (rank 4 and rank 64) on synthetic models. The goal
is real <= estimate <= 1.10 x real on every row.

    python -m corral.bench.estimates [--quick] [--only NAME,...] [MODELS_DIR]

`--only` measures the models whose names contain one of the given words (e.g. `--only
mmproj,lora` for the rows of models with parts).
"""

from __future__ import annotations

import asyncio
import math
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corral.core.estimate import check_kv_cache_type, estimate
from corral.core.gguf import ModelInfo, read_adapter_info, read_model_info, read_projector_info
from corral.core.spec import Adapter, RunnerSpec
from corral.runtime.runner import Runner
from corral.testing import ggufwrite, synth

MIB = 2**20
GOAL_MAX_RATIO = 1.10
LOAD_TIMEOUT = 120.0
N_CTX = (512, 2048, 8192)
PARALLEL = (1, 2, 4)
# Slots on one unified KV cache (CORRAL_NUM_PARALLEL auto): measured at f16 (the cache's type
# changes the rows the same way with one stream as with several).
UNIFIED_PARALLEL = (2, 4)
KV_TYPES = ("f16", "q8_0", "q4_0")


# A model's parts: (model path, models dir) -> (projector, adapters), written beside it.
Parts = Callable[[Path, Path], tuple[Path | None, tuple[Adapter, ...]]]


@dataclass(frozen=True)
class BenchModel:
    name: str
    write: Callable[[Path], Path] | None  # None: a file that ships (SmolLM2)
    quantized_kv: bool = False  # also measure q8_0 and q4_0 KV caches
    base: str | None = None  # a model with parts: the file of this model (written first)
    parts: Parts | None = None


def _projector(**dims: Any) -> Parts:
    def write(model: Path, d: Path) -> tuple[Path | None, tuple[Adapter, ...]]:
        n_embd = read_model_info(model).n_embd
        tag = "-".join(f"{v}" for v in dims.values()) or "tiny"
        path = d / f"mmproj-{model.stem}-{tag}.gguf"
        if not path.is_file():
            synth.write_projector(path, n_embd, **dims)
        return path, ()

    return write


def _lora(rank: int, targets: tuple[str, ...] = ("attn_output", "ffn_down")) -> Parts:
    def write(model: Path, d: Path) -> tuple[Path | None, tuple[Adapter, ...]]:
        path = d / f"lora-{model.stem}-r{rank}.gguf"
        if not path.is_file():
            synth.write_lora_adapter(path, model, rank=rank, targets=targets)
        return None, (Adapter(str(path), 1.0),)

    return write


def _models() -> list[BenchModel]:
    return [
        BenchModel("llama-tiny", lambda p: synth.write_llama_model(p)),
        BenchModel(
            "llama-20mb", lambda p: synth.write_llama_model(p, target_bytes=20_000_000), True
        ),
        BenchModel(
            "llama-200mb", lambda p: synth.write_llama_model(p, target_bytes=200_000_000), True
        ),
        BenchModel("llama-vocab49k", lambda p: synth.write_llama_model(p, n_vocab=None)),
        BenchModel("gemma3-swa", lambda p: synth.write_swa_model(p)),
        # 8 layers: layer 5 attends globally, so both KV caches (full and SWA) exist.
        BenchModel("gemma3-swa-8l", lambda p: synth.write_swa_model(p, n_layer=8)),
        BenchModel("bert", lambda p: synth.write_bert_model(p)),
        BenchModel("moe", lambda p: synth.write_moe_model(p, n_layer=4, n_expert=8)),
        BenchModel("smollm2", None, True),
        # Models with parts: a vision projector (mmproj), LoRA adapters.
        BenchModel("llama-tiny+mmproj", None, base="llama-tiny", parts=_projector()),
        BenchModel(
            "llama-20mb+mmproj-vit",
            None,
            base="llama-20mb",
            parts=_projector(
                n_embd=768,
                n_ff=3072,
                n_layer=3,
                n_head=12,
                image_size=336,
                patch_size=14,
                hidden=1024,
            ),
        ),
        BenchModel("llama-tiny+lora", None, base="llama-tiny", parts=_lora(4)),
        BenchModel(
            "llama-20mb+lora-r64",
            None,
            base="llama-20mb",
            parts=_lora(64, ("attn_q", "attn_v", "attn_output", "ffn_up", "ffn_down")),
        ),
    ]


# quick: one combination per kind of model, a few seconds in all (CI smoke).
_QUICK = (
    ("llama-tiny", 512, 1, "f16", False),
    ("llama-tiny", 2048, 4, "f16", True),
    ("gemma3-swa-8l", 2048, 2, "f16", False),
    ("gemma3-swa-8l", 2048, 4, "f16", True),
    ("bert", 512, 2, "f16", False),
    ("bert", 512, 4, "f16", True),
    ("llama-20mb", 2048, 2, "q8_0", False),
    ("llama-tiny+mmproj", 512, 1, "f16", False),
    ("llama-tiny+lora", 512, 1, "f16", False),
)
# Models with parts: fewer combinations (the parts do not depend on the context).
PARTS_N_CTX = (512, 2048)
PARTS_PARALLEL = (1, 2)


def _path(model: BenchModel, models_dir: Path) -> Path | None:
    if model.base is not None:
        base = next(m for m in _models() if m.name == model.base)
        return _path(base, models_dir)
    if model.write is None:
        return ggufwrite.smollm2_path()
    path = models_dir / f"{model.name}.gguf"
    if not path.is_file():
        model.write(path)
    return path


def _combinations(info: ModelInfo, model: BenchModel) -> Iterator[tuple[int, int, str, bool]]:
    """(n_ctx, slots, KV cache type, unified cache) to load the model with."""
    ctx_len = info.context_length or max(N_CTX)
    contexts = sorted({min(n, ctx_len) for n in (PARTS_N_CTX if model.parts else N_CTX)})
    kv_types = KV_TYPES if model.quantized_kv else KV_TYPES[:1]
    for kv in kv_types:
        check_kv_cache_type(info, kv)
        for n_ctx in contexts:
            for parallel in PARTS_PARALLEL if model.parts else PARALLEL:
                yield n_ctx, parallel, kv, False
    for n_ctx in contexts:
        for parallel in PARTS_PARALLEL[1:] if model.parts else UNIFIED_PARALLEL:
            yield n_ctx, parallel, KV_TYPES[0], True


async def _measure(
    name: str,
    info: ModelInfo,
    n_ctx: int,
    parallel: int,
    kv: str,
    projector: Path | None = None,
    adapters: tuple[Adapter, ...] = (),
    unified: bool = False,
) -> dict[str, Any]:
    embedding = "embedding" in info.capabilities
    spec = RunnerSpec(
        path=str(info.path),
        n_ctx=n_ctx,
        num_parallel=parallel,
        embedding=embedding,
        pooling_type=info.pooling_type if embedding else None,
        kv_cache_type=kv,
        projector=str(projector) if projector else None,
        adapters=adapters,
        kv_unified=unified,
    )
    est = estimate(
        info, n_ctx, parallel, kv,
        projector=read_projector_info(projector) if projector else None,
        adapters=[read_adapter_info(a.path) for a in adapters], unified=unified,
    )  # fmt: skip
    row: dict[str, Any] = {
        "model": name,
        "arch": info.architecture,
        "n_ctx": n_ctx,
        "parallel": parallel,
        "unified": unified,
        "kv_type": kv,
        "estimate": est.total,
    }
    runner = Runner(name, spec)
    try:
        await runner.start(LOAD_TIMEOUT)
        alloc = runner.allocation
    except Exception as e:  # a failed load is a result too; the other rows still run
        return {**row, "real": None, "ratio": math.nan, "error": str(e).splitlines()[0]}
    finally:
        await runner.stop()
    if alloc is None:
        return {**row, "real": None, "ratio": math.nan, "error": "no allocation in the log"}
    return {
        **row,
        "real": alloc.total,
        "ratio": est.total / alloc.total,
        "model_bytes": alloc.model_bytes,
        "kv_bytes": alloc.kv_bytes,
        "compute_bytes": alloc.compute_bytes,
    }


async def _run(models_dir: Path, quick: bool, only: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    rows = []
    quick_models = {q[0] for q in _QUICK}
    for model in _models():
        if quick and model.name not in quick_models:
            continue
        if only and not any(word in model.name for word in only):
            continue
        path = _path(model, models_dir)
        if path is None:  # SmolLM2's wheel is not installed
            continue
        info = read_model_info(path)
        projector, adapters = model.parts(path, models_dir) if model.parts else (None, ())
        if quick:
            combos = [(c, p, kv, u) for m, c, p, kv, u in _QUICK if m == model.name]
        else:
            combos = list(_combinations(info, model))
        for n_ctx, parallel, kv, unified in combos:
            rows.append(await _measure(
                model.name, info, n_ctx, parallel, kv, projector, adapters, unified
            ))  # fmt: skip
    return rows


def run(
    models_dir: Path | None = None, quick: bool = False, only: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """Load each model at each combination, one runner at a time; one row per load with
    estimate and real (llama.cpp's allocation) in bytes, ratio = estimate / real, and the real
    weights / KV cache / compute buffers. Models are written to `models_dir` (kept, and reused
    when already there) or to a temporary directory."""
    if models_dir is not None:
        models_dir.mkdir(parents=True, exist_ok=True)
        return asyncio.run(_run(models_dir, quick, only))
    with tempfile.TemporaryDirectory(prefix="corral-estimates-") as tmp:
        return asyncio.run(_run(Path(tmp), quick, only))


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MIB:.2f}"


def _par(r: dict[str, Any]) -> str:
    """Slots, with a `u` for a unified KV cache the slots share."""
    return f"{r['parallel']}{'u' if r.get('unified') else ''}"


def _cells(r: dict[str, Any]) -> tuple[str, ...]:
    real = r.get("real")
    return (
        r["model"], r["arch"], str(r["n_ctx"]), _par(r), r["kv_type"],
        _mib(r["estimate"]), _mib(real), "error" if real is None else f"{r['ratio']:.3f}",
        _mib(r.get("model_bytes")), _mib(r.get("kv_bytes")), _mib(r.get("compute_bytes")),
    )  # fmt: skip


def format_table(rows: list[dict[str, Any]]) -> str:
    """A plain-text table, one line per row, then the lowest and highest ratio (the worst
    case against the goal real <= estimate <= 1.10 x real)."""
    head = (
        "model", "arch", "n_ctx", "par", "kv", "estimate MiB", "real MiB", "ratio",
        "weights", "kv cache", "compute",
    )  # fmt: skip
    lines = [_cells(r) for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *lines, strict=True)]

    def fmt(cells: tuple[str, ...]) -> str:
        return "  ".join(
            c.ljust(w) if i < 5 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    out = [fmt(head), "  ".join("-" * w for w in widths)]
    out += [fmt(line) for line in lines]
    measured = [r for r in rows if r.get("real") is not None]
    for r in rows:
        if r.get("real") is None:
            out.append(f"error: {r['model']} n_ctx={r['n_ctx']} par={_par(r)}: {r['error']}")
    if measured:
        lo = min(measured, key=lambda r: r["ratio"])
        hi = max(measured, key=lambda r: r["ratio"])
        ok = sum(1.0 <= r["ratio"] <= GOAL_MAX_RATIO for r in measured)

        def where(r: dict[str, Any]) -> str:
            return f"{r['model']} n_ctx={r['n_ctx']} par={_par(r)} kv={r['kv_type']}"

        out.append("")
        out.append(f"lowest ratio  {lo['ratio']:.4f}  ({where(lo)})")
        out.append(f"highest ratio {hi['ratio']:.4f}  ({where(hi)})")
        out.append(
            f"{ok}/{len(measured)} rows within real <= estimate <= {GOAL_MAX_RATIO:.2f} x real"
        )
    return "\n".join(out)


def main(argv: list[str]) -> int:
    quick = "--quick" in argv
    only: tuple[str, ...] = ()
    if "--only" in argv:
        i = argv.index("--only")
        only = tuple(w for w in argv[i + 1].split(",") if w) if i + 1 < len(argv) else ()
        argv = argv[:i] + argv[i + 2 :]
    dirs = [a for a in argv if not a.startswith("-")]
    rows = run(Path(dirs[0]) if dirs else None, quick=quick, only=only)
    print(format_table(rows))
    bad = [r for r in rows if not 1.0 <= r["ratio"] <= GOAL_MAX_RATIO]  # nan fails too
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
