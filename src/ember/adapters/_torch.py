"""What the transformers families share: loading safely, the torch forward half with
LoRA switching (`TorchForward`), dynamic padding, token-budget checks, the device, and
the adapter state and lifecycle (`TorchModel`)."""

from __future__ import annotations

import asyncio
import gc
import warnings
from collections.abc import Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

from ember.adapters._arrays import IdRow, padded
from ember.adapters._tokenize import TextTokenizer, off_loop
from ember.adapters.base import (
    DOCUMENT_PROMPTS,
    EncodeOptions,
    Entity,
    ExtractOptions,
    ModelInfo,
    Runtime,
    Submit,
    TaskOutput,
    TokenSpan,
    check_lora,
    default_threads,
    forward_fills_cores,
)
from ember.config import ModelSpec
from ember.engine.types import PreparedItem, RequestResult
from ember.errors import InvalidInput, ModelLoadError, UnsupportedOutput, UnsupportedTask
from ember.model_files import read_model_file, read_model_json

if TYPE_CHECKING:
    from ember.adapters._backend import Forward


def st_modules(model_dir: Path, model: str) -> list[tuple[str, Path]]:
    """A sentence-transformers directory's modules.json, in order: each module's kind (its
    class name) and folder, which must lie inside the model's directory."""
    modules = []
    for module in read_model_file(model_dir / "modules.json", model, list):
        if not isinstance(module, dict):
            raise ModelLoadError(model, "modules.json: each module is a JSON object with "
                                        "a type and a path")
        relative = str(module.get("path", ""))
        path = (model_dir / relative).resolve()
        if not path.is_relative_to(model_dir.resolve()):
            raise ModelLoadError(model, f"modules.json: module path {relative!r} leaves the "
                                        "model's directory")
        modules.append((str(module.get("type", "")).rsplit(".", 1)[-1], path))
    return modules


_torch_forwards = False  # a model with torch forwards set torch's threads in this process


def apply_runtime(runtime: Runtime) -> None:
    """Set torch's thread count (process-wide, as torch has it): the runtime's, else all
    cores but one; torch's own choice (every core) collapses when a neighbour holds one
    (README, Backends and threads)."""
    global _torch_forwards
    _torch_forwards = True
    torch.set_num_threads(runtime.torch_threads or default_threads())


def apply_runtime_around_onnx(runtime: Runtime) -> None:
    """Torch's threads where the forwards run on ONNX Runtime: one, for the small padding
    and pooling around them, whose OpenMP team would otherwise spin after each on the
    cores ONNX Runtime's threads need (on 2 cores 1.07-1.12x the requests/s; see
    docs/bench/notes.md). A torch model in the same process, or `--torch-threads`, keeps
    its own setting."""
    if not _torch_forwards and runtime.torch_threads is None:
        torch.set_num_threads(1)


def load_kwargs(spec: ModelSpec) -> dict[str, Any]:
    """from_pretrained arguments every family uses: offline, safetensors unless allowed."""
    return {
        "local_files_only": True,
        "trust_remote_code": spec.trust_remote_code,
        # None lets transformers fall back to a pickle checkpoint; True refuses one.
        "use_safetensors": None if spec.allow_pickle else True,
    }


def place(model: torch.nn.Module, runtime: Runtime) -> torch.nn.Module:
    """Move to the runtime's device (fp16 on CUDA) in eval mode."""
    if runtime.half:
        model = model.half()
    return model.to(torch.device(runtime.device)).eval()


def model_max_length(spec: ModelSpec, config: Any, tokenizer: Any,
                     configured: int | None = None) -> int:
    """The token limit: the spec's, else the model directory's, within the positions."""
    positions = getattr(config, "max_position_embeddings", None)
    limit = spec.max_seq_length or configured
    if limit is None:
        tok_limit = getattr(tokenizer, "model_max_length", None)
        # Tokenizers without a limit report a huge sentinel (1e30).
        limit = tok_limit if tok_limit and tok_limit < 1_000_000 else positions
    if limit is None:
        raise ModelLoadError(spec.name, "no max_seq_length in the spec or the model directory")
    if positions is not None and limit > positions:
        raise ModelLoadError(spec.name, f"max_seq_length {limit} exceeds the model's "
                                        f"{positions} position embeddings")
    return int(limit)


@contextmanager
def fitting(name: str, path: Path) -> Iterator[None]:
    """A LoRA made for another base fails in torch's words, a line per weight (1,800
    characters for a tiny model): one line naming the LoRA and its folder instead."""
    try:
        yield
    except RuntimeError as exc:
        lines = [line.strip() for line in str(exc).splitlines() if "size mismatch" in line]
        if not lines:
            raise
        more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
        raise ValueError(f"LoRA {name!r} ({path}) was made for another model: "
                         f"{lines[0].rstrip('.')}{more}") from None


class TorchForward:
    """The forward half on torch: the model with its PEFT LoRA adapters on the runtime's
    device, called with padded inputs and returning one named output (`output`, e.g.
    last_hidden_state or logits); `None` (the base) is active after loading."""

    backend = "torch"

    def __init__(self, model: torch.nn.Module, loras: Mapping[str, Path],
                 runtime: Runtime, output: str) -> None:
        self.loras: tuple[str, ...] = tuple(loras)
        self.output = output
        self.active: str | None = None
        self._peft: Any = None
        if loras:
            model = self._attach(model, loras)
        # Placed after the adapters attach, so base and adapters share device and dtype.
        self.model = place(model, runtime)

    def __call__(self, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        result: torch.Tensor = getattr(self.model(**inputs), self.output)
        return result

    def run_arrays(self, inputs: Mapping[str, npt.NDArray[np.int64]]) -> npt.NDArray[Any]:
        device = next(self.model.parameters()).device
        with torch.inference_mode():
            tensors = {name: torch.from_numpy(array).to(device) for name, array in inputs.items()}
            output: npt.NDArray[Any] = self(tensors).float().cpu().numpy()
        return output

    def _attach(self, model: torch.nn.Module, loras: Mapping[str, Path]) -> torch.nn.Module:
        from peft import PeftModel  # only models with adapters pay for the import

        for name, path in loras.items():
            # A path PEFT cannot find locally would be taken for a hub id and fetched.
            if not (Path(path) / "adapter_config.json").is_file():
                raise FileNotFoundError(f"LoRA {name!r}: {path} is not a PEFT adapter "
                                        f"directory (no adapter_config.json)")
        first, *rest = self.loras
        with warnings.catch_warnings(), fitting(first, loras[first]):
            # peft 0.21 reads an attribute transformers 5 deprecated; nothing to act on.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing",
                                    category=FutureWarning)
            peft_model = PeftModel.from_pretrained(model, str(loras[first]),
                                                   adapter_name=first)
        for name in rest:
            with fitting(name, loras[name]):
                peft_model.load_adapter(str(loras[name]), adapter_name=name)
        self._peft = peft_model
        # The worker assumes the base is active until it first calls set_lora.
        self._peft.base_model.disable_adapter_layers()
        return peft_model

    def set_lora(self, name: str | None) -> None:
        if name == self.active:
            return
        if name is None:
            self._peft.base_model.disable_adapter_layers()
        else:
            if name not in self.loras:
                raise KeyError(f"unknown LoRA {name!r}; known: {', '.join(self.loras)}")
            self._peft.base_model.enable_adapter_layers()
            self._peft.set_adapter(name)
        self.active = name

    def check_lora(self, name: str | None, param: str = "params.options.lora") -> None:
        check_lora(name, self.loras, param)

    def memory_bytes(self) -> int:
        return module_bytes(self.model)

    def close(self) -> None:
        """Drop the weights; the forward is unusable afterwards."""
        self.model = torch.nn.Module()
        self._peft = None


def pad(rows: Sequence[IdRow], value: int, device: torch.device) -> torch.Tensor:
    """Right-pad rows of token ids to the longest row (dynamic padding)."""
    return torch.from_numpy(padded(rows, value)[0]).to(device)


def pad_with_mask(rows: Sequence[IdRow], value: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`pad`'s ids and their attention mask (1 on a row's own tokens), padded once."""
    ids, mask = padded(rows, value)
    return torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device)


def require_items(count: int) -> None:
    if count == 0:
        raise InvalidInput("at least one item is required; send 1 or more texts", "items")


def module_bytes(model: torch.nn.Module) -> int:
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class TorchModel:
    """The state and lifecycle every transformers family's adapter shares: the spec,
    the tokenizer, the device and the forward half (`model`, torch or ONNX Runtime,
    see _backend). A family sets `info` in its __init__; none of them extracts
    entities."""

    info: ModelInfo
    tokens: TextTokenizer  # set by each family, at its own token limit

    def __init__(self, spec: ModelSpec, tokenizer: Any, runtime: Runtime,
                 model: Forward) -> None:
        self.spec = spec
        self.tokenizer = tokenizer
        self.device = torch.device(runtime.device)
        self.pad_id = int(tokenizer.pad_token_id or 0)
        self.model = model
        self.fills_host_cores = forward_fills_cores(runtime, model.backend)

    def set_lora(self, name: str | None) -> None:
        """Runs in the worker's thread, between forwards."""
        self.model.set_lora(name)

    # -- the tokenizer shown (ShowsTokens): what a family reads, as it reads it ---------

    def side_prefix(self, options: EncodeOptions) -> str:
        """The prompt put before a text of the side `options` names; none by default."""
        return ""

    def reads(self, text: str) -> str:
        """A text as the tokenizer is given it (a family may lower its case)."""
        return text

    async def token_spans(self, texts: Sequence[str], special: bool,
                          options: EncodeOptions) -> list[list[TokenSpan]]:
        prefix = self.side_prefix(options)

        def spans(text: str) -> list[TokenSpan]:
            read = self.reads(text)
            origin = None
            if len(read) != len(text):  # each character of the text, as many read
                origin = [i for i, c in enumerate(text) for _ in self.reads(c)]
                origin.append(len(text))
            return self.tokens.spans(read, special, text, origin)

        whole = [prefix + text for text in texts]
        return await off_loop(sum(map(len, whole)), lambda: [spans(text) for text in whole])

    async def decode_ids(self, rows: Sequence[Sequence[int]],
                         skip_special: bool) -> list[str]:
        # About 4 characters an id: many go to the pool, as a long text does.
        return await off_loop(4 * sum(map(len, rows)),
                              lambda: self.tokens.decode(rows, skip_special, "ids"))

    async def extract(self, submit: Submit, texts: Sequence[str],
                      options: ExtractOptions) -> TaskOutput[list[list[Entity]]]:
        raise UnsupportedTask(self.spec.name, "extract", self.info.tasks)

    def memory_bytes(self) -> int:
        return self.model.memory_bytes()

    def close(self) -> None:
        self.model.close()
        release(self.device)


# -- loading, and the bi-encoders' request path ---------------------------------------


def load_config(spec: ModelSpec, model_dir: Path) -> Any:
    """The directory's transformers config, offline, its config.json read under the model
    files' limits first (transformers reads it unchecked)."""
    from transformers import AutoConfig

    if (path := model_dir / "config.json").is_file():
        read_model_file(path, spec.name)
    return AutoConfig.from_pretrained(str(model_dir), local_files_only=True,
                                      trust_remote_code=spec.trust_remote_code)


def load_tokenizer(spec: ModelSpec, model_dir: Path) -> Any:
    """The directory's fast tokenizer, offline; a slow-only tokenizer fails the load."""
    from transformers import AutoTokenizer

    rows = embedding_rows(model_dir)  # config.json through the size and depth checks first
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), use_fast=True,
                                              local_files_only=True,
                                              trust_remote_code=spec.trust_remote_code)
    if not tokenizer.is_fast:
        raise ModelLoadError(spec.name, "a fast (tokenizers) tokenizer is required; the "
                                        "model directory needs a tokenizer.json")
    # Without its vocabulary files transformers builds a tokenizer of special tokens only:
    # every word would be [UNK], and every text the same vector.
    if rows is not None and len(tokenizer) < rows // 2:
        raise ModelLoadError(spec.name, f"the tokenizer knows {len(tokenizer)} tokens where "
                                        f"the model embeds {rows}: its files (tokenizer.json, "
                                        "vocab.txt...) are missing from the model directory "
                                        "or belong to another model")
    return tokenizer


def embedding_rows(model_dir: Path) -> int | None:
    """The model's vocabulary size by its config.json (a text tower's, for CLIP), read
    under the model files' limits before transformers reads it unchecked."""
    path = model_dir / "config.json"
    if not path.is_file():
        return None
    config = read_model_json(path)
    for where in (config, config.get("text_config")):
        if isinstance(where, dict) and isinstance(where.get("vocab_size"), int):
            return int(where["vocab_size"])
    return None


def refuse_loras(spec: ModelSpec, family: str) -> None:
    if spec.loras:
        raise ModelLoadError(spec.name, f"the {family} family does not take LoRA adapters; "
                                        f"remove 'loras' from the spec")


def side_prefix(model: str, prompts: Mapping[str, str], is_query: bool,
                instruction: str | None) -> str:
    """The text put before each input: an instruction, then the side's prompt.
    Only a model configured with prompts was trained to follow an instruction."""
    if instruction and not any(prompts.values()):
        raise InvalidInput(f"model {model!r} has no prompts configured, so it takes no "
                           "instruction; drop params.instruction, or set 'prompts' in its "
                           "YAML", "params.instruction")
    if is_query:
        prompt = prompts.get("query", "")
    else:  # the first the folder names, in the order sentence-transformers looks for them
        side = next((name for name in DOCUMENT_PROMPTS if name in prompts), None)
        prompt = prompts[side] if side else ""
    return f"{instruction} {prompt}" if instruction else prompt


def check_output_types(requested: Sequence[str], supported: Sequence[str]) -> tuple[str, ...]:
    """The requested output types, deduplicated (none: the model's first); any the model
    cannot produce is a 422."""
    if not requested:
        return (supported[0],)
    unknown = [t for t in requested if t not in supported]
    if unknown:
        raise UnsupportedOutput(f"output_types {list(requested)} not supported; this model "
                                f"returns {list(supported)}", "params.output_types")
    return tuple(dict.fromkeys(requested))


async def submit_sides(submit: Submit, items: Sequence[PreparedItem], query_params: Hashable,
                       doc_params: Hashable, lora: str | None
                       ) -> tuple[list[RequestResult], list[Any]]:
    """Score's query (items[0]) and documents (the rest): one submit when both sides
    share parameters, else the two sides concurrently. Values come back query first."""
    if query_params == doc_params:
        result = await submit(items, query_params, lora)
        return [result], list(result.values)
    docs = [PreparedItem(item.payload, item.cost, i) for i, item in enumerate(items[1:])]
    sides = [asyncio.ensure_future(submit(items[:1], query_params, lora)),
             asyncio.ensure_future(submit(docs, doc_params, lora))]
    try:
        q_result, d_result = await asyncio.gather(*sides)
    except BaseException:
        for side in sides:  # one side failed (or the request ended): the other's items go
            side.cancel()   # too, not through forwards nobody awaits (R9)
        raise
    return [q_result, d_result], [*q_result.values, *d_result.values]
