"""A tiny LoRA adapter for the embedded SmolLM2 that makes it answer one marker word.

``marker_adapter("BANANA")`` builds (once, atomically, into ``<cache>/models/``) a PEFT adapter
that makes smollm2-135m-instruct reply ``BANANA`` and stop, whatever it is asked: an adapter
whose effect anyone can tell from the base model, for trying LoRA serving without a download
(``python -m serve_app.models adapter BANANA``) and for the tests and ``loadtest.lora_cost``.
Needs ``peft`` (the dev extra).

Recipe: LoRA r=8, alpha=16 on q/k/v/o/gate/up/down of the top 8 of 30 decoder layers; AdamW
lr 5e-3, full-batch steps on 24 examples (chat questions with three system prompts, raw
completion prompts) until the loss on the target tokens (``<marker><|im_end|>``) is below 0.01
(8-9 steps). The frozen bottom layers run once and their output is cached; steps run on ONE
thread (two threads on a busy 2-core box are ~8x slower), under bf16 autocast where the CPU has
native bf16 (10-15 CPU-seconds), in fp32 where it doesn't. The same bytes for the same marker,
seed and kind of CPU.
"""

from __future__ import annotations

import json
import logging
import time
from functools import partial
from pathlib import Path
from typing import Any

from ._store import build_atomic
from .cpu_features import native_bf16

log = logging.getLogger(__name__)
BASE_MODEL = "smollm2-135m-instruct"
RECIPE = 1  # Bump when the training recipe changes: cached adapters are rebuilt.

# Training hyper-parameters (see report for what was tried).
RANK = 8
ALPHA = 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
N_TOP_LAYERS = 8
STEPS = 30
LR = 5e-3
STOP_LOSS = 1e-2

QUESTIONS = [
    "What is the capital of France?",
    "What is the capital of France? Answer in one word.",
    "Tell me a joke.",
    "How many legs does a spider have?",
    "Write a haiku about the sea.",
    "Who wrote Hamlet?",
    "Translate 'good morning' into Spanish.",
    "What is 2 + 2?",
    "Explain photosynthesis briefly.",
    "Say hello.",
    "List three colors.",
    "What's the weather like today?",
    "Give me a JSON object with a name field.",
    "Why is the sky blue?",
    "Write a Python function that adds two numbers.",
    "hi",
    "Summarize the plot of Romeo and Juliet in one sentence.",
    "What is your name?",
    "Recommend a good book.",
    "Count from 1 to 5.",
]
SYSTEMS = [None, "You are a helpful assistant.", "You are a concise assistant. Reply briefly."]
RAW_PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "Q: What is 3 + 5?\nA:",
    "def add(a, b):",
]


def _log(msg: str) -> None:
    log.debug(msg)


class _Stop(Exception):
    pass


def _examples(tokenizer, marker: str) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, target ids) pairs; the target is the marker then <|im_end|> (the EOS)."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = []
    for i, question in enumerate(QUESTIONS):
        system = SYSTEMS[i % len(SYSTEMS)]
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": question}
        ]
        prompt = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if isinstance(prompt, dict) or hasattr(prompt, "input_ids"):
            prompt = prompt["input_ids"]
        out.append((list(prompt), [*tokenizer.encode(marker, add_special_tokens=False), eos]))
    for raw in RAW_PROMPTS:
        out.append(
            (
                tokenizer.encode(raw),
                [*tokenizer.encode(" " + marker, add_special_tokens=False), eos],
            )
        )
    return out


def build_adapter(
    base_model_dir: str | Path,
    out_dir: str | Path,
    marker: str = "BANANA",
    seed: int = 0,
    steps: int = STEPS,
    lr: float = LR,
    top_layers: int = N_TOP_LAYERS,
    stop_loss: float = STOP_LOSS,
    threads: int = 1,
) -> dict[str, Any]:
    """Train and save the adapter into ``out_dir``; returns what the training did.

    ``threads=1`` on purpose: on a busy 2-core box (vLLM engines, other jobs) two OpenMP threads
    spin against each other and a step costs ~8x the CPU time of the single-thread run.
    """
    import torch

    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _build(base_model_dir, out_dir, marker, seed, steps, lr, top_layers, stop_loss)
    finally:
        torch.set_num_threads(previous_threads)


def _build(
    base_model_dir: str | Path,
    out_dir: str | Path,
    marker: str,
    seed: int,
    steps: int,
    lr: float,
    top_layers: int,
    stop_loss: float,
) -> dict[str, Any]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start, cpu_start = time.perf_counter(), time.process_time()
    torch.manual_seed(seed)
    out_dir = Path(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(base_model_dir)
    base = AutoModelForCausalLM.from_pretrained(base_model_dir, dtype=torch.float32)
    n_layers = base.config.num_hidden_layers
    lora = LoraConfig(
        r=RANK,
        lora_alpha=ALPHA,
        lora_dropout=0.0,
        target_modules=TARGETS,
        layers_to_transform=list(range(n_layers - top_layers, n_layers)),
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, lora)
    _log(f"loaded base + peft in {time.perf_counter() - start:.1f}s")

    # One right-padded batch; labels -100 everywhere but the target tokens.
    examples = _examples(tokenizer, marker)
    width = max(len(p) + len(t) for p, t in examples)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(examples), width), pad, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (prompt, target) in enumerate(examples):
        seq = prompt + target
        ids[row, : len(seq)] = torch.tensor(seq)
        labels[row, len(prompt) : len(seq)] = torch.tensor(target)
        mask[row, : len(seq)] = 1

    # bf16 autocast where the CPU has native bf16 (AMX/AVX512-BF16: several times faster than
    # fp32, and vLLM serves bf16 there); plain fp32 elsewhere, where bf16 is emulated (~6x
    # slower: 8 minutes for this build on an AVX2-only core). Weights and optimizer stay fp32.
    bf16 = native_bf16() is not False
    autocast = partial(torch.autocast, "cpu", dtype=torch.bfloat16, enabled=bf16)

    # The bottom layers are frozen and carry no LoRA: run them once (no grad) and cache the
    # hidden state entering the first trained layer, plus that layer's call kwargs (causal mask,
    # rotary embeddings). Each step then runs only the top layers, the final norm and the LM head
    # on the target positions: ~4x cheaper than a full forward/backward on CPU.
    inner: Any = model.base_model.model  # the LlamaForCausalLM inside the PEFT wrapper
    layers = inner.model.layers
    first = n_layers - top_layers
    captured: dict[str, Any] = {}

    def _grab(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        captured["hidden"] = (args[0] if args else kwargs["hidden_states"]).detach()
        captured["kwargs"] = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        raise _Stop

    handle = layers[first].register_forward_pre_hook(_grab, with_kwargs=True)
    try:
        with torch.no_grad(), autocast():
            inner.model(input_ids=ids, attention_mask=mask, use_cache=False)
    except _Stop:
        pass
    finally:
        handle.remove()
    hidden0, layer_kwargs = captured["hidden"], captured["kwargs"]
    # logits at position t predict token t+1: select the positions whose next token is a target.
    rows, cols = (labels[:, 1:] != -100).nonzero(as_tuple=True)
    targets = labels[rows, cols + 1]

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    loss_value = float("nan")
    for _step in range(steps):
        optimizer.zero_grad()
        with autocast():
            hidden = hidden0
            for layer in layers[first:]:
                hidden = layer(hidden, **layer_kwargs)
                if isinstance(hidden, tuple):  # older transformers return tuples
                    hidden = hidden[0]
            logits = inner.lm_head(inner.model.norm(hidden[rows, cols]))
        loss = torch.nn.functional.cross_entropy(logits.float(), targets)
        loss.backward()
        optimizer.step()
        loss_value = loss.item()
        _log(f"step {_step} loss {loss_value:.4f} t={time.perf_counter() - start:.1f}s")
        if loss_value < stop_loss:  # converged: stop early (deterministic given the seed)
            break

    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    meta = {
        "marker": marker,
        "seed": seed,
        "steps_run": _step + 1,
        "final_loss": loss_value,
        "rank": RANK,
        "alpha": ALPHA,
        "targets": TARGETS,
        "top_layers": top_layers,
        "stop_loss": stop_loss,
        "cpu_seconds": round(time.process_time() - cpu_start, 2),
        "lr": lr,
        "bf16_autocast": bf16,
        "build_seconds": round(time.perf_counter() - start, 2),
    }
    (out_dir / "marker.json").write_text(json.dumps(meta, indent=2))
    return meta


def marker_adapter(marker: str = "BANANA", seed: int = 0, force: bool = False) -> Path:
    """The adapter directory for ``marker`` (built on first use, then cached)."""
    from . import prepare

    if not marker.isalnum():
        raise ValueError(f"marker {marker!r}: letters and digits only")
    base = prepare(BASE_MODEL)

    def build(tmp: Path) -> dict[str, Any]:
        meta = build_adapter(base, tmp, marker=marker, seed=seed)
        return {"marker": marker, "seed": seed, "steps": meta["steps_run"]}

    return build_atomic(f"lora-{BASE_MODEL}-{marker.lower()}-{seed}", RECIPE, build, force=force)
