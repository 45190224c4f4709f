"""Briefs file → captions file: the designer's inference entry point (`atelier designer generate`).

A designer output is either an HF model directory (`runs/d1/model`, or any base model) or a PEFT
adapter directory (`runs/d1/adapter`), whose `adapter_config.json` names its base model. Briefs come one
per line (blank lines skipped) or as JSONL with a "brief" field; every line is checked and a bad one is
reported as `file:line`. The output is JSONL: {"brief", "caption"} per brief, in input order.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from atelier_studio.data.chat import DataError, prompt_ids
from atelier_studio.data.textfile import iter_lines, read_json
from atelier_studio.data.tokenizer import load_tokenizer
from atelier_studio.designer.decoder import CausalLM
from atelier_studio.designer.generate import generate
from atelier_studio.designer.hf import load_pretrained
from atelier_studio.designer.lora import load_peft_adapter
from atelier_studio.pipeline.atomic import atomic_write_text, check_dir_path
from atelier_studio.pipeline.errors import ModelLoadError, WriteError
from atelier_studio.pipeline.hf_files import check_vocab_size
from atelier_studio.pipeline.hub import resolve_model_path


def read_briefs(path: Path) -> list[str]:
    return [text for _, text in read_brief_lines(path)]


def read_brief_lines(path: Path) -> list[tuple[str, str]]:
    """("file:line", brief) for each brief of the file, so a brief found bad later is named where it is."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: briefs file not found")
    briefs = []
    for n, line in iter_lines(path):  # a non-UTF-8 line is a DataError naming path:line
        text = line.strip()
        if not text:
            continue
        if text.startswith("{"):
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: invalid JSON ({e.msg})") from None
            text = obj.get("brief") if isinstance(obj, dict) else None
            if not isinstance(text, str) or not text.strip():
                raise DataError(f"{path}:{n}: expected a non-empty \"brief\" string")
            text = text.strip()
        briefs.append((f"{path}:{n}", text))
    if not briefs:
        raise DataError(f"{path}: no briefs")
    return briefs


def check_prompt_lengths(prompts: list[list[int]], sources: list[str], max_new_tokens: int, max_seq_len: int) -> None:
    """A DataError naming the first brief whose prompt and new tokens do not fit the model's context, with the limit."""
    room = max_seq_len - max_new_tokens
    for ids, where in zip(prompts, sources):
        if len(ids) > room:
            fix = f"shorten the brief to at most {room} tokens or lower" if room > 0 else "lower"
            raise DataError(f"{where}: the brief is {len(ids)} tokens with its chat template; with max_new_tokens "
                            f"{max_new_tokens} it needs {len(ids) + max_new_tokens} of the model's max_seq_len "
                            f"{max_seq_len}: {fix} --max-new-tokens")


def load_designer(path: Path, device: torch.device, dtype: torch.dtype = torch.float32) -> tuple[CausalLM, object]:
    """A model directory, or an adapter directory applied to its base. Returns (model, tokenizer)."""
    path = Path(path)
    adapter_cfg = path / "adapter_config.json"
    if adapter_cfg.is_file():
        cfg = read_json(adapter_cfg, ModelLoadError)
        base = cfg.get("base_model_name_or_path") if isinstance(cfg, dict) else None
        base = resolve_model_path(base, f"{adapter_cfg}: base_model_name_or_path") if base else base
        if not base or not Path(base).is_dir():
            raise FileNotFoundError(f"{adapter_cfg}: base_model_name_or_path {base!r} is not a local directory")
        model = load_pretrained(base, dtype=dtype, device=device)
        load_peft_adapter(model, path)
        tokenizer_dir = path if (path / "tokenizer.json").is_file() else Path(base)
    else:
        model = load_pretrained(path, dtype=dtype, device=device)
        tokenizer_dir = path
    model.eval()
    tokenizer = load_tokenizer(tokenizer_dir)
    check_vocab_size(tokenizer, tokenizer_dir, model.args.vocab_size, path)  # a tokenizer without its vocabulary
    return model, tokenizer


def generate_captions(model_dir: Path, adapter_dir: Path | None, briefs_file: Path, out_file: Path,
                      max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                      batch_size: int = 16, device: str = "auto",
                      sources: list[str] | None = None) -> list[dict[str, str]]:
    """Captions for the briefs of `briefs_file` → `out_file`. `sources` names each brief ("file:line") in errors
    when the briefs file was written from another (the evaluation's); by default its own lines are named."""
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    lines = read_brief_lines(briefs_file)
    briefs = [text for _, text in lines]
    if sources is None or len(sources) != len(briefs):
        sources = [where for where, _ in lines]
    out_file = Path(out_file)
    if out_file.is_dir():  # found now, not after generating
        raise WriteError(f"--out {out_file}: is a directory; expected the path of a JSONL file to write")
    check_dir_path(out_file.parent, "--out's directory")
    model, tokenizer = load_designer(Path(model_dir), dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
    if adapter_dir is not None:
        load_peft_adapter(model, adapter_dir)
    prompts = [prompt_ids(tokenizer, b) for b in briefs]
    check_prompt_lengths(prompts, sources, max_new_tokens, model.args.max_seq_len)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        outputs = generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                           top_p=top_p, seed=seed, eos_token_id=eos, batch_size=batch_size)
    rows = [{"brief": b, "caption": tokenizer.decode(ids, skip_special_tokens=True).strip()}
            for b, ids in zip(briefs, outputs)]
    atomic_write_text(out_file, "".join(json.dumps(r) + "\n" for r in rows), what="captions file")
    return rows
