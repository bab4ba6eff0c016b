"""``tiny-qwen2``: a deterministic random-weight Qwen2 model for fast tests.

The architecture and tokenizer mimic Qwen2.5-Instruct (ChatML special tokens,
chat template with tools, eos ``<|im_end|>``) so serving code paths behave as
with the real model, while the whole checkpoint is well under 1 MB.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

# Bump whenever the produced files change: older caches are then rebuilt.
RECIPE = 1
SEED = 1234

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# Plain added tokens in Qwen2.5 (not "special"): they must survive
# skip_special_tokens so vLLM's hermes tool parser can see them.
TOOL_TOKENS = ("<tool_call>", "</tool_call>")

# Qwen2's pre-tokenizer split pattern (GPT-4 style, single digits).
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BPE_VOCAB = 4096  # upper bound; the small corpus yields ~1.2k tokens
MAX_LEN = 4096

MODEL_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,  # head_dim 32: vLLM's CPU attention rejects 16
    "num_key_value_heads": 1,  # GQA, as in the real Qwen2.5 models
    "intermediate_size": 128,
    "max_position_embeddings": MAX_LEN,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
}


def _train_bpe() -> Tokenizer:
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    from ._corpus import CORPUS

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_BPE_VOCAB,
        show_progress=False,
        # Full byte alphabet: any UTF-8 text stays encodable (no <unk>).
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    # Added after training so they get the highest ids, as in Qwen2.5.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return tok


def build_tokenizer() -> PreTrainedTokenizerFast:
    from transformers import PreTrainedTokenizerFast

    from ._templates import QWEN25_CHAT_TEMPLATE

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_bpe(),
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        bos_token=None,  # Qwen2 prepends no BOS
        model_max_length=MAX_LEN,
        clean_up_tokenization_spaces=False,
        chat_template=QWEN25_CHAT_TEMPLATE,
    )
    return tokenizer


def _token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(token_id, int):
        raise RuntimeError(f"{token} is not a single token")
    return token_id


def _vocab_size(n_tokens: int) -> int:
    # Pad the embedding like Qwen does (config vocab > tokenizer length).
    return -(-n_tokens // 128) * 128


def build(dest: Path) -> dict[str, Any]:
    """Write the tokenizer and a seeded random checkpoint into ``dest``."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from ._jsonfile import update_json

    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(dest)
    # transformers 5 writes its generic "TokenizersBackend", which 4.x cannot
    # resolve; "Qwen2TokenizerFast" loads tokenizer.json as-is in both.
    update_json(dest / "tokenizer_config.json", {"tokenizer_class": "Qwen2TokenizerFast"})
    ids = {t: _token_id(tokenizer, t) for t in SPECIAL_TOKENS}

    config = Qwen2Config(
        vocab_size=_vocab_size(len(tokenizer)),
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=ids[IM_END],
        pad_token_id=ids[ENDOFTEXT],
        **MODEL_SHAPE,
    )
    # Seeded CPU init, then bf16: bit-identical across runs and machines
    # with the same torch/transformers versions. fork_rng keeps the caller's
    # global RNG state untouched (we may run inside a serving actor).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        # Any: transformers' stubs mistype the wrapped nn.Module.to().
        model: Any = Qwen2ForCausalLM(config)
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16  # recorded as "dtype" in config.json
    model.generation_config = GenerationConfig(
        bos_token_id=ids[ENDOFTEXT],
        # Qwen2.5-Instruct stops on either; <|im_end|> first.
        eos_token_id=[ids[IM_END], ids[ENDOFTEXT]],
        pad_token_id=ids[ENDOFTEXT],
    )
    model.save_pretrained(dest)
    return {
        "seed": SEED,
        "tokenizer_len": len(tokenizer),
        "vocab_size": config.vocab_size,
        "eos_token_id": ids[IM_END],
    }
