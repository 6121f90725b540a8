"""`ember serve` and `ember models`. Every flag has an EMBER_* environment variable.
Flags are matched exactly (`allow_abbrev=False`): `--model` is never read as
`--model-dir`."""

from __future__ import annotations

import argparse
import difflib
import logging
import math
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import NoReturn, cast

from ember import __version__, hub
from ember.config import (
    SPINNING,
    CatalogError,
    ModelSpec,
    RaySettings,
    ServerSettings,
    files_here,
    hub_id,
    hub_ref,
    hub_wanted,
    load_catalog,
    local_name,
    spec_for_model,
    spinning_mode,
    with_hub_models,
)
from ember.engine import WorkerConfig
from ember.engine.config import DISPATCH_MODES, SettingError
from ember.errors import closest, did_you_mean
from ember.logs import FORMATS, LEVELS

log = logging.getLogger("ember")


def number(text: str) -> float:
    """A flag's finite number: float() reads "nan" and "inf", which no setting means."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


# The flags' defaults are the settings' own: one place for each.
SERVER = ServerSettings()
WORKER = WorkerConfig()

# (flag, type, default, help); the variable is EMBER_ + the flag in upper snake case.
Parse = Callable[[str], object]  # a flag's type: a class, or `number`
WORKER_FLAGS: list[tuple[str, Parse, object, str]] = [
    ("max-batch-tokens", int, None, "padded tokens per forward (items x longest; default: "
     "learned, what a forward of about 250 ms holds, or 32 fixed costs' worth where that is "
     "more, at least 512 and at most 16384)"),
    ("max-batch-items", int, WORKER.max_batch_items, "items per forward"),
    ("dispatch", str, WORKER.dispatch, "auto: the batch windows below that are not set follow the "
     "cost per forward the engine measures on each model; fixed: unset windows take the "
     "fixed defaults (10 ms, 1.05, 3 ms, 16384 tokens)"),
    ("max-batch-wait-ms", number, None, "longest a batch stays open after its first item "
     "(default: learned, at most 10)"),
    ("max-padding", number, None, "padded tokens a batch may hold per real token (plus 4 a "
     "text); 0 turns the cap off (default: learned; 1.05 until learned)"),
    ("idle-coalesce-ms", number, None, "quiet time that closes a burst reaching an idle model "
     "(default: learned, at most 3)"),
    ("lead-ratio", number, WORKER.lead_ratio,
     "a request with at most 1/this the items of the largest "
     "queued beside it leads the next forward (a query beside a bulk request); 0: off"),
    ("max-queue-items", int, WORKER.max_queue_items, "queued items per model before 429"),
]


def env_name(flag: str) -> str:
    return "EMBER_" + flag.replace("-", "_").upper()


def env_default(flag: str, kind: Parse, default: object) -> object:
    raw = os.environ.get(env_name(flag))
    if raw is None:
        return default
    if kind is bool:
        if raw.strip().lower() not in TRUE + FALSE:  # "maybe" is neither: say so
            raise ValueError(raw)
        return raw.strip().lower() in TRUE
    return kind(raw)


TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


class AppendOverEnv(argparse.Action):
    """`append`, except that the first flag given replaces the default (which may have
    come from the EMBER_* variable, as one string) instead of appending to it."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[object] | None, option_string: str | None = None
                 ) -> None:
        current = getattr(namespace, self.dest, None)
        items = [] if current is self.default or current is None else list(current)
        setattr(namespace, self.dest, [*items, values])


class BadVariable:
    """The default an EMBER_* variable gave a flag, when it does not parse: an error only
    where the flag does not replace it (so `ember models`, `--version`, `--help`, and a
    start that gives the flag, are not held by it)."""

    def __init__(self, message: str, raw: str) -> None:
        self.message, self.raw = message, raw

    def __repr__(self) -> str:  # what --help shows as the default
        return repr(self.raw)


class Parser(argparse.ArgumentParser):
    """argparse with a suggestion for a mistyped flag (`--max-loaded` for
    `--max-loaded-models`), as the YAML fields have, and the refusal, in one line, of a
    bad variable that no flag replaced."""

    words: Sequence[str] = ()

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        self.words = list(sys.argv[1:] if args is None else args)
        parsed = super().parse_args(self.words, namespace)
        for value in vars(parsed).values():
            if isinstance(value, BadVariable):
                self.refuse_variable(value)
        return parsed

    def refuse_variable(self, bad: BadVariable) -> NoReturn:
        """One line, without the usage: the usage lists the flags, and no flag was wrong."""
        chosen = self._chosen() or self
        chosen.exit(2, f"{chosen.prog}: error: {bad.message}\n")

    def error(self, message: str) -> NoReturn:
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            hints = [hint for word in message[len(prefix):].split()
                     if word.startswith("--") and (hint := self._hint(word.split("=")[0]))]
            if hints:
                message += "; " + ", ".join(hints)
        # The chosen command's usage, not the top level's: argparse reports a command's
        # unknown flags from here.
        chosen = self._chosen() or self
        chosen.print_usage(sys.stderr)
        chosen.exit(2, f"{chosen.prog}: error: {message}\n")

    def _hint(self, flag: str) -> str | None:
        """The chosen command's closest flag, or the command that has this one."""
        commands, chosen = self._commands(), self._chosen()
        own = [name for action in (chosen or self)._actions for name in action.option_strings]
        for command, parser in commands.items():
            if parser is not chosen and any(flag in a.option_strings for a in parser._actions):
                return f"{flag} is a flag of `ember {command}`"
        match = closest(flag, own)
        return f"{flag} (did you mean {match}?)" if match else None

    def _chosen(self) -> argparse.ArgumentParser | None:
        commands = self._commands()
        return next((commands[word] for word in self.words if word in commands), None)

    def _commands(self) -> dict[str, argparse.ArgumentParser]:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return dict(action.choices)
        return {}


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default in its help, unless the help says it already or it has none."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        # The key's default is EMBER_API_KEY's value: help ends up in logs and tickets.
        if action.default is None or "(default" in text or action.dest == "api_key":
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="ember", description="Ember: embeddings, reranking and entity "
                    "extraction, batched.", allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"ember {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve models over HTTP", allow_abbrev=False,
                                formatter_class=DefaultsHelp,
                                description="Serve the catalog over HTTP. Each flag can also "
                                "be set by the EMBER_* variable named in its help.")

    def flag(name: str, kind: Parse, default: object, text: str, env_choices: bool = True,
             **extra: object) -> None:
        value: object
        try:
            value = env_default(name, kind, default)
        except ValueError:
            wanted = (f"one of {', '.join(repr(v) for v in TRUE + FALSE if v)}"
                      if kind is bool else f"a valid {kind.__name__}")
            raw = os.environ[env_name(name)]
            value = BadVariable(f"{env_name(name)}={raw!r} is not {wanted}", raw)
        choices = cast("list[object] | None", extra.get("choices"))
        if (env_choices and choices is not None and not isinstance(value, BadVariable)
                and value not in choices):  # argparse checks the flags' own
            value = BadVariable(f"{env_name(name)}={value!r} is not one of "
                                f"{', '.join(map(repr, choices))}", str(value))
        if kind is bool:
            serve.add_argument(f"--{name}", action="store_true", default=value,
                               help=f"{text} [{env_name(name)}]")
        else:
            serve.add_argument(f"--{name}", type=kind, default=value,
                               help=f"{text} [{env_name(name)}]", **extra)  # type: ignore[arg-type]

    flag("host", str, SERVER.host, "address to listen on")
    flag("port", int, SERVER.port, "port to listen on")
    flag("workers", int, SERVER.workers,
         "API processes (HTTP, validation, tokenizing) beside one engine "
         "process that batches and runs the models; 0 runs everything in one process "
         "(best on small machines; see the README)")
    flag("model-dir", str, None, "folder of extra model YAML files (repeatable; the "
         "variable takes a list separated by ':')", action=AppendOverEnv)
    flag("model", str, None, "a Hugging Face Hub id (org/name[@revision]), downloaded at "
         "startup and served under its name, or a local model directory served as "
         "local/<dir name>; the family is read from the files (repeatable; the variable "
         "takes a list separated by ':')", action=AppendOverEnv)
    flag("preload", str, None, "model to load at startup besides the default, a catalog "
         "name, a model folder or a Hub id (repeatable; the variable takes a "
         "comma-separated list)",
         action=AppendOverEnv)
    flag("default-model", str, SERVER.default_model, "model behind /embed, /rerank, /v1/embeddings "
         "and /readyz: a catalog name, a model folder (served as local/<folder>) or a Hub "
         "id")
    flag("allow-hub-models", bool, SERVER.allow_hub_models,
         "let a request name a Hub model the server does "
         "not have, which it then downloads; off, only the models named at startup are "
         "downloaded")
    flag("max-download-gb", number, SERVER.max_download_gb, "the largest model a request may "
         "make the server download, with --allow-hub-models (models named at the start "
         "are not limited)")
    flag("device", str, SERVER.device, "cpu, cuda or cuda:N (fp16 on CUDA)")
    flag("torch-threads", int, None, "torch intra-op threads (default: all cores but one; 1 "
         "where every model runs on ONNX Runtime)")
    flag("backend", str, SERVER.backend, "forward backend, torch or onnx: onnx runs the models it "
         "can (CPU, no LoRAs), torch the rest; a model's YAML 'backend:' overrides it",
         choices=["torch", "onnx"])
    flag("cache-dir", str, None,
         "folder for ONNX exports (default $XDG_CACHE_HOME/ember or ~/.cache/ember)")
    flag("onnx-threads", int, None, "ONNX Runtime intra-op threads (default: every core)")
    flag("onnx-spinning", str, SERVER.onnx_spinning,
         "when ONNX Runtime's threads spin-wait: 'forward' "
         "(within a forward, then they sleep), 'on' (also between forwards, which takes "
         "the cores the front end needs) or 'off' (never; each step of a forward wakes "
         "them); the flag alone means 'on'", choices=list(SPINNING), nargs="?", const="on",
         env_choices=False)  # its variable also takes yes/no words (spinning_mode reads it)
    for name, kind, default, text in WORKER_FLAGS:
        flag(name, kind, default, text,
             choices=list(DISPATCH_MODES) if name == "dispatch" else None)
    flag("max-items-per-request", int, SERVER.max_items_per_request,
         "items in one request before 413 (OpenAI's "
         "2,048; the engine splits a request into forwards of --max-batch-items)")
    flag("max-body-bytes", int, SERVER.max_body_bytes, "request body size before 413")
    flag("max-text-chars", int, SERVER.max_text_chars,
         "characters in one text before 422 (a text is "
         "cut to the model's token limit only after this check)")
    flag("max-images-per-request", int, SERVER.max_images_per_request,
         "images in one request before 413")
    flag("request-timeout-s", number, None, "end a request with 504 after this long; its "
         "queued work is dropped")
    flag("max-loaded-models", int, SERVER.max_loaded_models,
         "models in memory at once (LRU eviction)")
    flag("memory-budget-mb", int, None, "weights in memory before LRU eviction")
    flag("api-key", str, None, "require 'Authorization: Bearer <key>' (all but /healthz, "
         "/readyz and /health)")
    flag("cors-allow-origin", str, None, "let pages from this browser origin "
         "(scheme://host[:port]) call the server, or * for any; preflights pass without "
         "the API key (repeatable; the variable takes a comma-separated list)",
         action=AppendOverEnv)
    flag("allowed-host", str, None, "a name the Host header may give (as clients reach the "
         "server: api.example.com), or * for any; default: any, but only loopback names "
         "when bound to loopback, which keeps web pages from driving it by DNS rebinding "
         "(repeatable; the variable takes a comma-separated list)", action=AppendOverEnv)
    flag("forwarded-allow-ips", str, None, "proxies (comma-separated addresses or "
         "networks, * for any) whose X-Forwarded-For and X-Forwarded-Proto are believed: "
         "the access log then names the client behind the proxy (default: believe none)")
    flag("token-ids", str, SERVER.token_ids, "token-id input on /v1/embeddings: refuse (a 422 "
         "that says to send text: clients such as LangChain send OpenAI's tiktoken ids, "
         "which no other model reads right), or model (read them as ids of the model's own "
         "tokenizer)", choices=["refuse", "model"])
    ray = RaySettings()  # the defaults of the Ray flags (measured: docs/scaling.md)
    flag("ray", bool, False, "serve on Ray Serve: engine replicas (one per device) behind "
         "ingress replicas (--workers of them); needs the ray extra (docs/scaling.md)")
    flag("ray-address", str, None, "with --ray, join the Ray cluster at this address "
         "instead of starting a local instance")
    flag("replicas", int, ray.replicas, "with --ray, engine replicas (without autoscaling "
         "bounds)")
    flag("min-replicas", int, ray.min_replicas, "with --ray, autoscale the engine replicas "
         "from this many")
    flag("max-replicas", int, ray.max_replicas, "with --ray, autoscale the engine replicas "
         "up to this many")
    flag("max-ongoing-requests", int, None, "with --ray, requests one engine replica holds "
         "at once (default: --max-queue-items, so Ember's own queue answers 429 when a "
         "replica is full; docs/scaling.md)")
    flag("max-queued-requests", int, None, "with --ray, requests Ray's router holds while "
         "every engine replica is full, before it answers 429 (default: --max-batch-items)")
    flag("target-ongoing-requests", number, ray.target_ongoing_requests, "with --ray and "
         "autoscaling, the ongoing requests per engine replica to scale towards (default: "
         "2 x --max-batch-items, two full batches of one-text requests)")
    flag("upscale-delay-s", number, ray.upscale_delay_s, "with --ray and autoscaling, load "
         "sustained this long before a replica is added")
    flag("downscale-delay-s", number, ray.downscale_delay_s, "with --ray and autoscaling, "
         "idleness sustained this long before a replica is removed")
    flag("ray-cpus", int, ray.num_cpus, "with --ray, logical CPUs of the local Ray "
         "instance (default: enough for every engine replica)")
    flag("log-level", str, SERVER.log_level, "debug, info, warning or error",
         metavar="{" + ",".join(LEVELS) + "}")
    flag("log-format", str, SERVER.log_format,
         "text, or json: one JSON object a line for log shippers",
         metavar="{" + ",".join(FORMATS) + "}")

    models = commands.add_parser("models", help="list the model catalog: name, tasks, "
                                 "state and dims", allow_abbrev=False,
                                 description="List the model catalog: each model's name, "
                                 "tasks, whether its files are on this machine (cached), "
                                 "their size, and with --url its live state and dims.")
    models.add_argument("--model-dir", action=AppendOverEnv,
                        default=os.environ.get(env_name("model-dir")),
                        help="folder of extra model YAML files (repeatable) "
                        f"[{env_name('model-dir')}], as `ember serve` reads them")
    models.add_argument("--url", default=None, help="a running server (http://host:port) "
                        "to ask for each model's live state and dims; without it, the "
                        "catalog alone (dims when its YAML gives them)")
    models.add_argument("--api-key", default=os.environ.get("EMBER_API_KEY"),
                        help="the server's API key, with --url [EMBER_API_KEY]")
    return parser


def _list(values: Sequence[str] | str | None, sep: str) -> tuple[str, ...]:
    if values is None:
        return ()
    if isinstance(values, str):
        values = [values]
    return tuple(part.strip() for value in values for part in value.split(sep) if part.strip())


def settings_from(args: argparse.Namespace) -> ServerSettings:
    if not args.ray:
        refuse_ray_flags(args)
    try:
        worker = WorkerConfig(**{name.replace("-", "_"): getattr(args, name.replace("-", "_"))
                                 for name, *_ in WORKER_FLAGS})
    except SettingError as exc:
        raise ValueError(f"--{exc.name.replace('_', '-')} {exc.problem} (or "
                         f"{env_name(exc.name)})") from None
    return ServerSettings(
        host=args.host, port=args.port, workers=args.workers,
        model_dirs=tuple(Path(p) for p in _list(args.model_dir, ":")),
        model_paths=tuple(Path(p) for p in _list(args.model, ":")),
        allow_hub_models=args.allow_hub_models, max_download_gb=args.max_download_gb,
        preload=_list(args.preload, ","), default_model=args.default_model,
        device=args.device, torch_threads=args.torch_threads, backend=args.backend,
        cache_dir=Path(args.cache_dir) if args.cache_dir else None,
        onnx_threads=args.onnx_threads, onnx_spinning=spinning_mode(args.onnx_spinning),
        worker=worker,
        max_items_per_request=args.max_items_per_request, max_body_bytes=args.max_body_bytes,
        max_text_chars=args.max_text_chars, max_images_per_request=args.max_images_per_request,
        request_timeout_s=args.request_timeout_s, max_loaded_models=args.max_loaded_models,
        memory_budget_mb=args.memory_budget_mb, api_key=args.api_key,
        cors_origins=_list(args.cors_allow_origin, ","),
        allowed_hosts=_list(args.allowed_host, ","),
        forwarded_allow_ips=args.forwarded_allow_ips, token_ids=args.token_ids,
        log_level=args.log_level.lower(), log_format=args.log_format.lower(),
        ray=ray_settings_from(args) if args.ray else None,
    )


def refuse_ray_flags(args: argparse.Namespace) -> None:
    """Without --ray its flags would be ignored: a ValueError instead."""
    given = ray_settings_from(args)
    if given != RaySettings():
        flags = {"address": "ray-address", "num_cpus": "ray-cpus"}  # the rest: by name
        names = [flags.get(name, name.replace("_", "-"))
                 for name in RaySettings.__dataclass_fields__
                 if getattr(given, name) != getattr(RaySettings(), name)]
        raise ValueError(f"--{', --'.join(names)} take effect with --ray only; add --ray "
                         "or leave them out")


def ray_settings_from(args: argparse.Namespace) -> RaySettings:
    return RaySettings(
        address=args.ray_address or None, replicas=args.replicas,
        min_replicas=args.min_replicas, max_replicas=args.max_replicas,
        max_ongoing_requests=args.max_ongoing_requests,
        max_queued_requests=args.max_queued_requests,
        target_ongoing_requests=args.target_ongoing_requests,
        upscale_delay_s=args.upscale_delay_s, downscale_delay_s=args.downscale_delay_s,
        num_cpus=args.ray_cpus)


def serve(settings: ServerSettings) -> int:
    from ember.logs import configure_logging

    configure_logging(settings)
    say_mistyped_variables(os.environ)
    try:
        known = load_catalog(settings.model_dirs, check_paths=True)
    except CatalogError as exc:
        log.error("%s", exc)
        return 2
    try:
        settings = with_hub_models(without_unavailable_preloads(settings, known), known)
        catalog = load_catalog(settings.model_dirs, settings.model_paths)
        say_folders_named_as_hub_ids(settings.model_paths)
        prefetch(settings, catalog)
    except CatalogError as exc:
        if settings.default_model in known or hub_id(settings.default_model) is None:
            log.error("%s", exc)
        else:  # the Hub's answer first, then, for a mistyped catalog name, which there are
            log.error("default model %r: as a Hub id, %s; nor is it in the catalog (%sknown: "
                      "%s)", settings.default_model, exc,
                      did_you_mean(settings.default_model, sorted(known)), ", ".join(sorted(known)))
        return 2
    hub.let_requests_download(settings.allow_hub_models, settings.max_download_gb)
    if settings.default_model not in catalog:
        log.error("default model %r is not in the catalog; known: %s",
                  settings.default_model, ", ".join(sorted(catalog)))
        return 2
    if settings.workers < 0:
        log.error("--workers must be 0 (one process) or more, got %d", settings.workers)
        return 2
    if settings.workers > (cores := os.cpu_count() or 1):
        log.warning("--workers %d is more API processes than this machine's %d cores: those "
                    "past the cores add memory (about 80 MB each), not throughput",
                    settings.workers, cores)
    if settings.max_loaded_models == 1 and len(catalog) > 1:
        log.warning("--max-loaded-models 1 holds the default model alone: any other model "
                    "is loaded for each request and evicted after it; raise it to keep "
                    "another model loaded")
    if settings.ray is not None:
        return serve_ray(settings)  # the replicas' machines hold the devices
    if (problem := device_problem(settings.device)) is not None:
        log.error("%s", problem)
        return 2
    if settings.workers:
        from ember.supervisor import serve_processes

        return serve_processes(settings)
    from ember.registry import Registry
    from ember.server import hold_stop_signals, run_http
    from ember.supervisor import listening_socket

    hold_stop_signals()
    if (sock := listening_socket(settings)) is None:
        return 1
    with sock:
        run_http(settings, Registry.serving(settings, catalog), sockets=[sock])
    return 0


def device_problem(device: str) -> str | None:
    """Why this machine cannot run forwards on `device`, if it cannot (checked at start:
    otherwise every model would fail to load and the server would run unready)."""
    if device == "cpu":
        return None
    import torch

    if not torch.cuda.is_available():
        return (f"--device {device}: torch {torch.__version__} sees no CUDA device on this "
                "machine; use --device cpu")
    count = torch.cuda.device_count()
    if int(device.partition(":")[2] or 0) >= count:
        return f"--device {device}: this machine has {count} CUDA devices (cuda:0-{count - 1})"
    return None


def say_folders_named_as_hub_ids(model_paths: Iterable[Path | str]) -> None:
    """A relative folder wins over the Hub id it spells: say so, once, in the first process."""
    for named in model_paths:
        path = Path(named).expanduser()
        if not path.is_absolute() and path.is_dir() and hub_id(named) is not None:
            log.warning("%s names the folder %s here, served as %s; the Hub repository of "
                        "that name is not fetched (give the folder's absolute path to say "
                        "so, or start from another folder for the Hub's)", named,
                        path.resolve(), local_name(path))


def without_unavailable_preloads(settings: ServerSettings,
                                 known: Mapping[str, ModelSpec]) -> ServerSettings:
    """A Hub id that only --preload names and that cannot be had (not on the Hub, the Hub
    unreachable, offline without it) is logged and skipped, as a catalog model's preload
    is: the start goes on without it."""
    named = {str(p) for p in settings.model_paths} | {settings.default_model}
    keep = []
    for name in settings.preload:
        if name not in known and name not in named and hub_id(name) is not None:
            try:
                spec_for_model(name, known)  # from the cache, else from the Hub
            except CatalogError as exc:
                log.error("could not preload %s: %s", name, exc)
                continue
        keep.append(name)
    return replace(settings, preload=tuple(keep))


def prefetch(settings: ServerSettings, catalog: dict[str, ModelSpec]) -> None:
    """Download, before anything serves, the Hub models this start names: the default
    model, the preloads and each --model (with `onnx/model.onnx` when the ONNX backend
    will run it). A default or --model that cannot be had stops the start; a preload is
    logged and skipped (its routes then say why)."""
    named = {str(p).split("@")[0] for p in settings.model_paths
             if not Path(p).expanduser().is_dir()}  # a folder that spells an id names the folder
    names = [spec.name for spec in catalog.values() if spec.source.hub is not None and (
        spec.name == settings.default_model or spec.name in settings.preload
        or spec.source.hub in named)]
    for name in dict.fromkeys(names):
        spec = catalog[name]
        try:
            folder = hub.snapshot(hub_ref(spec), hub_wanted(spec, settings.backend,
                                                           settings.device), download=True)
            hub.backbone_folder(folder, download=True)  # a GLiNER's tokenizer
        except FileNotFoundError as exc:
            if name in settings.preload and name != settings.default_model:
                log.error("could not fetch %s: %s", name, exc)
                continue
            raise CatalogError(str(exc)) from None


def serve_ray(settings: ServerSettings) -> int:
    """`--ray`: Ray is imported here only, so the default install never needs it."""
    assert settings.ray is not None
    problem = settings.ray.problem(settings.device)
    if problem:
        log.error("%s", problem)
        return 2
    try:
        from ember.cluster.run import serve_on_ray
    except ImportError as exc:
        log.error("--ray needs Ray Serve: pip install 'ember[ray]' (%s)", exc)
        return 2
    return serve_on_ray(settings)


def list_models(model_dirs: Sequence[str] | None, url: str | None = None,
                api_key: str | None = None) -> int:
    """A table of the catalog: name, tasks, whether its files are here (cached), their
    size, state and dims; state and dims live from a server with `url`. Nothing is
    downloaded."""
    catalog = load_catalog((Path(p) for p in _list(model_dirs, ":")), check_paths=True)
    rows = [(name, ",".join(spec.tasks), *local_files(spec), "-",
             str(spec.options.get("dims", "-"))) for name, spec in sorted(catalog.items())]
    if url is not None:
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            response = httpx.get(f"{url.rstrip('/')}/v1/models", headers=headers, timeout=10)
            if response.status_code == 401:  # httpx's own words name no flag to give a key
                print(f"ember: {key_refused(url, api_key)}", file=sys.stderr)
                return 1
            response.raise_for_status()
        except httpx.HTTPError as exc:
            print(f"ember: cannot list the models of {url}: {exc}", file=sys.stderr)
            return 1
        # Cached as the server says (its machine's files); the size where this one has them.
        try:
            rows = [(m["id"], ",".join(m["tasks"]),
                     {True: "yes", False: "no"}.get(m.get("cached"), "-"),
                     local_files(catalog[m["id"]])[1] if m["id"] in catalog else "-",
                     m["state"], "-" if m["dims"] is None else str(m["dims"]))
                    for m in response.json()["data"]]
        except (ValueError, KeyError, TypeError):  # an answer, but not an Ember server's
            print(f"ember: {url} answered /v1/models with no Ember model list; is it an "
                  "Ember server?", file=sys.stderr)
            return 1
    header = ("NAME", "TASKS", "CACHED", "SIZE", "STATE", "DIMS")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False))
              + "  " + row[-1])
    return 0


def key_refused(url: str, api_key: str | None) -> str:
    """What to do about a server's 401, in one line."""
    if api_key:
        return f"{url} refused the API key given (401); check --api-key or EMBER_API_KEY"
    return f"{url} needs an API key (401); give it with --api-key KEY or EMBER_API_KEY"


def quiet_on_closed_stdout(write: Callable[[], int]) -> int:
    """`write()`'s exit status; a reader that closed stdout early (`ember models | head -1`)
    ends it with status 1 and no traceback, as Python's docs advise (signal module)."""
    try:
        status = write()
        sys.stdout.flush()  # a broken pipe shows here, not in the interpreter's last flush
        return status
    except BrokenPipeError:
        # Python flushes stdout again at exit: devnull takes that flush without an error.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def local_files(spec: ModelSpec) -> tuple[str, str]:
    """Whether the model's files are on this machine (a Hub model in the Hub's cache, an
    installed package, a folder), and their size; `-` for a model without files."""
    if spec.adapter == "synthetic":
        return "-", "-"
    folder = files_here(spec)
    if folder is None:
        return "no", "-"
    return "yes", hub.human_bytes(hub.snapshot_bytes(folder))


def setting_variables() -> set[str]:
    """The EMBER_* variable of every `ember serve` flag."""
    serve_parser = next(action for action in build_parser()._actions
                        if isinstance(action, argparse._SubParsersAction)).choices["serve"]
    return {env_name(option[2:]) for action in serve_parser._actions
            for option in action.option_strings if option.startswith("--")}


def say_mistyped_variables(environment: Mapping[str, str]) -> None:
    """A variable that spells a setting's almost (EMBER_APIKEY) is ignored, as any other
    is: say so, or a server meant to need a key would start open without a word."""
    known = setting_variables()
    for name in sorted(environment):
        if name.startswith("EMBER_") and name not in known:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
            if close:
                log.warning("%s is not a setting and is ignored; did you mean %s?", name,
                            close[0])


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "models":
            return quiet_on_closed_stdout(
                lambda: list_models(args.model_dir, args.url, args.api_key))
        for name, value, allowed in (("--log-level", args.log_level, LEVELS),
                                     ("--log-format", args.log_format, FORMATS)):
            if value.lower() not in allowed:
                print(f"ember: {name} must be one of {', '.join(allowed)}, not {value!r}",
                      file=sys.stderr)
                return 2
        try:
            settings = settings_from(args)
        except ValueError as exc:  # a value no flag takes (the spinning mode, a limit)
            say_refused(str(exc), args.log_format)
            return 2
        return serve(settings)
    except CatalogError as exc:
        say_refused(str(exc), getattr(args, "log_format", "text"))
        return 2


def say_refused(message: str, log_format: str) -> None:
    """Why the start is refused, on stderr before logging is set up: a line of text, or
    under --log-format json a JSON line as every other is."""
    if log_format.lower() == "json":
        from ember.logs import JsonFormatter

        record = logging.LogRecord("ember", logging.ERROR, __file__, 0, message, None, None)
        print(JsonFormatter().format(record), file=sys.stderr)
    else:
        print(f"ember: {message}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
