"""The forward half on ONNX Runtime: where the graph comes from, and the session.

A model directory that ships `onnx/model.onnx` is loaded as it is. Otherwise the
torch model is exported once (torch's TorchScript exporter, eager attention, dynamic
batch and sequence axes), fused with onnxruntime's transformer optimizer where that
keeps parity, checked against torch on two input shapes, and cached under
`<cache dir>/onnx/<model>-<key>/`. The key covers the weights' and config's hash, the
exporter (torch's version), the opset, onnxruntime's version (its optimizer and
quantizer), the inputs and the output. `quantize: int8` adds onnxruntime's dynamic
int8 quantization of that graph, cached beside it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import stat
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import onnxruntime as ort
import torch

from ember.adapters.base import Runtime, check_lora, default_onnx_threads
from ember.config import ModelSpec
from ember.errors import ModelLoadError

log = logging.getLogger("ember.onnx")

OPSET = 17
EXPORTER = f"torch-{torch.__version__}-torchscript"
FORMAT = 1  # bump when what is exported, or how, changes
SHIPPED = Path("onnx") / "model.onnx"
# Model types whose graphs onnxruntime's transformer optimizer fuses as BERT's.
FUSABLE = {"bert", "roberta", "xlm-roberta", "camembert", "electra"}
CHECK_SHAPES = ((2, 16), (3, 37))  # (batch, sequence): the traced shape and another
Origin = Literal["shipped", "cached", "exported"]
CACHED_GRAPHS = 2  # the float graph and its int8 copy: a load may find each one damaged
# An export that cannot be written: the cache folder's fault, not the model's.
UNWRITABLE = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.ENOTDIR,
              errno.EEXIST}


def cache_root(runtime: Runtime) -> Path:
    """Where exports are cached: the runtime's, else $EMBER_CACHE_DIR, else the user's."""
    if runtime.cache_dir is not None:
        return runtime.cache_dir.expanduser()
    if env := os.environ.get("EMBER_CACHE_DIR"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(base).expanduser() / "ember"


def file_digest(paths: Sequence[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode())
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def weight_files(model_dir: Path) -> list[Path]:
    """The files that define the graph: weights (safetensors, else what the loader
    reads) and config.json."""
    weights = sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))
    config = model_dir / "config.json"
    return [*weights, *([config] if config.is_file() else [])]


@dataclass(frozen=True)
class ExportPlan:
    """What the family's forward feeds and reads: the graph's inputs and its output."""

    inputs: tuple[str, ...]
    output: str
    config: Any  # the transformers config of the model directory
    load_torch: Callable[[], torch.nn.Module]  # the model, loaded only to export it


class OnnxForward:
    """The forward half on ONNX Runtime: padded inputs in, the named output out, as a
    CPU tensor. No LoRAs (they need the torch backend)."""

    backend = "onnx"
    loras: tuple[str, ...] = ()

    def __init__(self, path: Path, runtime: Runtime, inputs: Sequence[str], output: str,
                 origin: Origin) -> None:
        self.path = path
        self.origin = origin
        self.output = output
        self.session: ort.InferenceSession | None = session(path, runtime)
        wanted = {i.name for i in self.session.get_inputs()}
        self.inputs = tuple(wanted)
        # A shipped graph may take token_type_ids a family does not pass: zeros, as torch.
        self.zero_inputs = tuple(name for name in wanted if name not in inputs)

    def __call__(self, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return torch.from_numpy(self.run_arrays({name: tensor.cpu().numpy()
                                                 for name, tensor in inputs.items()}))

    def run_arrays(self, inputs: Mapping[str, npt.NDArray[np.int64]]) -> npt.NDArray[Any]:
        assert self.session is not None, "the model was closed"
        feeds = {name: inputs[name] for name in self.inputs if name not in self.zero_inputs}
        for name in self.zero_inputs:
            feeds[name] = np.zeros(inputs["input_ids"].shape, dtype=np.int64)
        value: npt.NDArray[Any] = self.session.run([self.output], feeds)[0]
        return value

    def set_lora(self, name: str | None) -> None:
        if name is not None:
            raise KeyError(f"unknown LoRA {name!r}; the onnx backend has none")

    def check_lora(self, name: str | None, param: str = "params.options.lora") -> None:
        check_lora(name, self.loras, param)

    def memory_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.path.parent.glob("model.onnx*"))

    def close(self) -> None:
        self.session = None


def session_options(runtime: Runtime) -> ort.SessionOptions:
    """Ember's thread settings: `onnx_threads` intra-op threads (default every core),
    spinning as `onnx_spinning` says. By default ("forward") the threads spin between the
    steps of a forward, so no step waits for a thread to wake, and stop the moment the
    forward returns, so between forwards they leave the cores to the front end and an
    idle model costs no CPU (README, Backends and threads)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = runtime.onnx_threads or default_onnx_threads()
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    spins = runtime.onnx_spinning != "off"
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spins else "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    stop = runtime.onnx_spinning == "forward"
    options.add_session_config_entry("session.force_spinning_stop", "1" if stop else "0")
    options.log_severity_level = 3  # errors only
    return options


def session(path: Path, runtime: Runtime) -> ort.InferenceSession:
    """A CPU session over `path` with Ember's thread settings."""
    options = session_options(runtime)
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


# -- where the graph comes from -------------------------------------------------------


def load(spec: ModelSpec, model_dir: Path, runtime: Runtime, plan: ExportPlan) -> OnnxForward:
    """The model's ONNX forward: shipped, cached or exported now, then quantized if
    the spec asks."""
    if not runtime.device.startswith("cpu"):
        raise ModelLoadError(spec.name, f"the onnx backend runs on CPU only; set "
                                        f"backend: torch for device {runtime.device}")
    root = cache_root(runtime) / "onnx"
    for tries_left in reversed(range(CACHED_GRAPHS + 1)):
        path, origin = _fp32(spec, model_dir, plan, root)
        try:
            if spec.quantize == "int8":
                path, origin = _int8(spec, path, root)
            forward = OnnxForward(path, runtime, plan.inputs, plan.output, origin)
            break
        except Exception as exc:  # ONNX Runtime's own error types: a graph it cannot read
            if origin != "cached" or not tries_left:
                raise
            # A cache entry cut short (a full disk, an interrupted copy) is a miss, not a
            # model that fails for good: made again from the weights.
            log.warning("%s: the cached graph at %s does not load (%s: %s); making it again",
                        spec.name, path, type(exc).__name__, exc)
            path.unlink(missing_ok=True)
    log.info("%s: onnx backend, %s graph (%s) at %s", spec.name, spec.quantize or "float32",
             origin, path)
    return forward


def cache_entry(root: Path, name: str, model: str) -> Path:
    """The cache's folder `name` under `root` (made, as the folders above it, where
    missing), it and `root` checked by `trusted_folder`. --cache-dir itself may be open
    to others (a Kubernetes emptyDir is 0777): Ember's folders in it are its own."""
    try:
        for folder in (root, root / name):
            trusted_folder(folder, model)
    except OSError as exc:
        if exc.errno not in UNWRITABLE:
            raise
        raise unwritable(model, root, exc) from exc
    return root / name


def unwritable(model: str, root: Path, exc: OSError) -> ModelLoadError:
    """The cache folder's fault, not the model's: said so, with what to do."""
    return ModelLoadError(model, f"cannot write its ONNX export under {root} ({exc.strerror}); "
                                 "point --cache-dir (or EMBER_CACHE_DIR) at a writable folder "
                                 "with room, or serve it with backend: torch")


def trusted_folder(path: Path, model: str) -> Path:
    """`path`, made if missing (for this user alone), where no stranger may change what
    is in it: a graph found there is run as this server's code. Refused when anyone may
    write in it, or when it is another user's in a folder anyone may write in (a stranger
    made it); another user's elsewhere was given by whoever set the cache up (a prebuilt
    image's), and a group may share it."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    status = path.stat()
    made_by_anyone = (status.st_uid not in (os.getuid(), 0)
                      and path.parent.stat().st_mode & stat.S_IWOTH)
    open_to = ("every user may write in it" if status.st_mode & stat.S_IWOTH
               else "another user made it where every user may" if made_by_anyone else None)
    if open_to is not None:
        raise ModelLoadError(model, f"the ONNX cache folder {path} is open to other users "
                                    f"({open_to}): one could replace the graph this server "
                                    "runs; remove it (Ember makes it again, for its user "
                                    "alone), or point --cache-dir (or EMBER_CACHE_DIR) at a "
                                    "folder of your own")
    return path


def cached_graph(path: Path, model: str) -> bool:
    """Whether the cache holds the graph at `path`; one any user may write is refused."""
    if not path.is_file():
        return False
    if path.stat().st_mode & stat.S_IWOTH:
        raise ModelLoadError(model, f"the cached ONNX graph {path} may be written by every "
                                    "user: one could replace what this server runs; remove "
                                    "it (Ember exports it again)")
    return True


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "--", name).strip("-")


def export_key(model_dir: Path, plan: ExportPlan) -> str:
    fields = {"format": FORMAT, "weights": file_digest(weight_files(model_dir)),
              "exporter": EXPORTER, "opset": OPSET, "onnxruntime": ort.__version__,
              "inputs": list(plan.inputs), "output": plan.output}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def _fp32(spec: ModelSpec, model_dir: Path, plan: ExportPlan,
          root: Path) -> tuple[Path, Origin]:
    shipped = model_dir / SHIPPED
    if shipped.is_file():
        reason = _misfit(shipped, plan)
        if reason is None:
            return shipped, "shipped"
        log.warning("%s: not using the shipped %s (%s); exporting instead", spec.name,
                    SHIPPED, reason)
    target = cache_entry(root, f"{_slug(spec.name)}-{export_key(model_dir, plan)}",
                         spec.name) / "model.onnx"
    if cached_graph(target, spec.name):
        return target, "cached"
    try:
        export(spec.name, plan, target)
    except ModelLoadError:
        raise
    except Exception as exc:  # the exporter's failures come in many types
        if isinstance(exc, OSError) and exc.errno in UNWRITABLE:
            raise unwritable(spec.name, root, exc) from exc
        if type(exc).__name__ == "SafetensorError":  # torch could not read it either
            raise ModelLoadError(spec.name, f"its weights file is incomplete or corrupt "
                                            f"({exc}); fetch the model again") from exc
        if isinstance(exc, OSError) and "no file named" in str(exc):  # transformers' words
            if (model_dir / "pytorch_model.bin").is_file() and not spec.allow_pickle:
                raise ModelLoadError(spec.name, "its weights are a pickle (pytorch_model.bin); "
                                                "Ember loads safetensors unless the model's "
                                                "YAML says allow_pickle: true") from exc
            raise ModelLoadError(spec.name, f"its folder holds no weights file ({exc}); "
                                            "fetch the model again, or point its source at "
                                            "the folder that has them") from exc
        raise ModelLoadError(spec.name, f"cannot export to ONNX ({type(exc).__name__}: "
                                        f"{exc}); serve it with backend: torch") from exc
    return target, "exported"


def _misfit(path: Path, plan: ExportPlan) -> str | None:
    """Why a shipped graph does not fit the family's forward, or None if it does."""
    try:
        probe = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as exc:  # ONNX Runtime's own error types: empty, cut short, not ONNX
        return f"ONNX Runtime cannot read it: {type(exc).__name__}: {exc}"
    outputs = [o.name for o in probe.get_outputs()]
    inputs = {i.name for i in probe.get_inputs()}
    if plan.output not in outputs:
        return f"it has no output {plan.output!r}, only {outputs}"
    unknown = inputs - {*plan.inputs, "token_type_ids"}
    return f"it takes inputs {sorted(unknown)} Ember does not feed" if unknown else None


def _int8(spec: ModelSpec, source: Path, root: Path) -> tuple[Path, Origin]:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    key = hashlib.sha256(f"{file_digest([source])}/int8-per-channel/{ort.__version__}/"
                         f"{FORMAT}".encode()).hexdigest()[:16]
    target = cache_entry(root, f"{_slug(spec.name)}-int8-{key}", spec.name) / "model.onnx"
    if cached_graph(target, spec.name):
        return target, "cached"
    log.info("%s: quantizing to int8 (dynamic, onnxruntime) ...", spec.name)
    started = time.monotonic()
    quiet = _DropAdvice()
    logging.root.addFilter(quiet)
    try:
        with _staging(target) as staged:
            # Per channel: one scale per tensor cost MiniLM 0.96 mean cosine, this 0.99.
            # The fused operators carry no type annotations: float32 is the default.
            quantize_dynamic(source, staged, weight_type=QuantType.QInt8, per_channel=True,
                             extra_options={"DefaultTensorType": 1})  # TensorProto.FLOAT
    finally:
        logging.root.removeFilter(quiet)
    log.info("%s: quantized in %.1f s, cached at %s", spec.name, time.monotonic() - started,
             target)
    return target, "exported"


class _DropAdvice(logging.Filter):
    """The quantizer advises static-quantization pre-processing, which dynamic
    quantization does not need."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Please consider to run pre-processing")


STAGING = ".staging-"
# A staging folder whose owner cannot be told (another machine's, an older Ember's) is
# swept once untouched this long: no export runs for a day.
STAGING_ABANDONED_S = 24 * 3600.0


class _staging:
    """A temporary file beside `target`, moved into place on success: a crash or a
    concurrent load never leaves a half-written graph where the cache looks. The folders
    of exports that ended mid-way (a crash, or a server that left a load no request
    awaited) are swept by the next export beside them."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __enter__(self) -> Path:
        sweep_abandoned_staging(self.target.parent)
        self.dir = Path(tempfile.mkdtemp(prefix=f"{STAGING}{staging_owner()}-",
                                         dir=self.target.parent))
        return self.dir / self.target.name

    def __exit__(self, kind: object, *rest: object) -> None:
        staged = self.dir / self.target.name
        if kind is None:
            os.chmod(staged, 0o644)  # whatever the umask: no other user may change it
            os.replace(staged, self.target)
        # Not file by file by name: a folder swapped for a link meanwhile would have its
        # target emptied. rmtree refuses a link, and works through the folder's descriptor.
        shutil.rmtree(self.dir, ignore_errors=True)


def staging_owner() -> str:
    """This process, as its staging folders name it: host and pid."""
    return f"{_staging_host()}-{os.getpid()}"


def _staging_host() -> str:
    return socket.gethostname().replace("-", "_")  # "-" parts a staging folder's name


def sweep_abandoned_staging(folder: Path) -> None:
    """Remove the staging folders in `folder` that no export will finish: this machine's
    whose process is gone, and any untouched for STAGING_ABANDONED_S."""
    host = _staging_host()
    for staged in folder.glob(f"{STAGING}*"):
        owner = staged.name[len(STAGING):].split("-")
        try:
            mine = len(owner) >= 3 and owner[0] == host and owner[1].isdigit()
            if (mine and not process_alive(int(owner[1]))) or (
                    time.time() - staged.stat().st_mtime > STAGING_ABANDONED_S):
                shutil.rmtree(staged, ignore_errors=True)
        except OSError:  # swept by another process meanwhile
            continue


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


# -- export ---------------------------------------------------------------------------


class _Exported(torch.nn.Module):
    """The model with positional inputs and one output, as the exporter wants it."""

    def __init__(self, model: torch.nn.Module, inputs: Sequence[str], output: str) -> None:
        super().__init__()
        self.model = model
        self.names = tuple(inputs)
        self.output = output

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = getattr(self.model(**dict(zip(self.names, tensors,
                                                              strict=True))), self.output)
        return result


def sample_inputs(inputs: Sequence[str], vocab_size: int, batch: int,
                  length: int) -> dict[str, torch.Tensor]:
    """Seeded inputs of one shape; every row after the first is padded, so the traced
    graph and the checks cover the attention mask."""
    generator = torch.Generator().manual_seed(batch * 1000 + length)
    ids = torch.randint(5, max(6, vocab_size), (batch, length), generator=generator)
    lengths = torch.tensor([length] + [max(2, length // (i + 2)) for i in range(batch - 1)])
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    samples = {"input_ids": ids * mask, "attention_mask": mask,
               "token_type_ids": (torch.arange(length)[None, :] >= lengths[:, None] // 2)
               .long() * mask}
    return {name: samples[name] for name in inputs}


def export(name: str, plan: ExportPlan, target: Path) -> None:
    """Export, fuse where parity holds, check, and move into `target`; logs progress."""
    log.info("%s: exporting to ONNX (first load under this name and these weights; cached "
             "at %s) ...", name, target.parent)
    started = time.monotonic()
    model = plan.load_torch().eval()
    wrapper = _Exported(model, plan.inputs, plan.output)
    vocab = int(getattr(plan.config, "vocab_size", 1000))
    checks = [sample_inputs(plan.inputs, vocab, b, n) for b, n in CHECK_SHAPES]
    with torch.no_grad():
        expected = [wrapper(*c.values()).float().numpy() for c in checks]
    axes = {n: {0: "batch", 1: "sequence"} for n in plan.inputs}
    axes[plan.output] = {0: "batch", 1: "sequence"} if expected[0].ndim == 3 else {0: "batch"}
    with _staging(target) as staged, warnings.catch_warnings():
        # The tracer's warnings concern shapes the checks below verify.
        warnings.simplefilter("ignore")
        plain = staged.with_name("plain.onnx")
        torch.onnx.export(wrapper, tuple(checks[0].values()), str(plain),
                          input_names=list(plan.inputs), output_names=[plan.output],
                          dynamic_axes=axes, opset_version=OPSET, dynamo=False)
        log.info("%s: exported in %.1f s; fusing with onnxruntime's optimizer ...", name,
                 time.monotonic() - started)
        chosen, worst = plain, _parity(plain, plan, checks, expected)
        if worst is None:
            raise ModelLoadError(name, "the exported graph does not reproduce the torch "
                                       "model's outputs; serve it with backend: torch")
        fused = _fuse(plain, staged.with_name("fused.onnx"), plan.config)
        fused_worst = None if fused is None else _parity(fused, plan, checks, expected)
        if fused is not None and fused_worst is not None:
            chosen, worst = fused, fused_worst
        os.replace(chosen, staged)
    meta = {"model": name, "exporter": EXPORTER, "opset": OPSET,
            "onnxruntime": ort.__version__, "fused": chosen.name == "fused.onnx",
            "max_abs_diff_vs_torch": worst, "seconds": round(time.monotonic() - started, 2)}
    (target.parent / "meta.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
    log.info("%s: ONNX graph ready in %.1f s (%s; max difference from torch %.2g)", name,
             meta["seconds"], "fused" if meta["fused"] else "unfused", worst)


def _parity(path: Path, plan: ExportPlan, checks: Sequence[Mapping[str, torch.Tensor]],
            expected: Sequence[npt.NDArray[np.float32]]) -> float | None:
    """The largest difference from torch over the real (unpadded) positions, or None if
    it passes 1e-4 of the outputs' scale (fp32 arithmetic in another order)."""
    check = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    worst = 0.0
    for inputs, want in zip(checks, expected, strict=True):
        got = check.run([plan.output], {k: v.numpy() for k, v in inputs.items()})[0]
        if got.shape != want.shape:
            return None
        keep = inputs["attention_mask"].numpy().astype(bool)
        if want.ndim != 3:  # one value per row (a classifier's logits)
            keep = np.ones(want.shape[0], dtype=bool)
        diff = float(np.abs(got[keep] - want[keep]).max())
        if not diff <= 1e-4 * (1.0 + float(np.abs(want[keep]).max())):
            return None
        worst = max(worst, diff)
    return worst


def _fuse(source: Path, target: Path, config: Any) -> Path | None:
    """onnxruntime's transformer fusions (attention, layer norm, GELU) for the model
    types it knows; None for others, or when it fails."""
    if getattr(config, "model_type", None) not in FUSABLE:
        return None
    from onnxruntime.transformers.optimizer import optimize_model

    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("fusion", "onnx_model")):  # the optimizer's per-step chatter
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        fused = optimize_model(str(source), model_type="bert",
                               num_heads=int(config.num_attention_heads),
                               hidden_size=int(config.hidden_size), opt_level=1)
        fused.save_model_to_file(str(target))
    except Exception as exc:  # an unfused graph still serves; say why
        log.warning("fusion failed (%s: %s); keeping the unfused graph", type(exc).__name__,
                    exc)
        return None
    return target
