"""Tokenizer wrapper: encoding, chat templates and token strings for one served model."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path


class ChatTemplateError(ValueError):
    """The model's chat template could not render the messages."""


class Tokenizer:
    """A Hugging Face fast tokenizer plus the model's EOS ids and chat template."""

    def __init__(self, model_path: str | Path, chat_template: str | None = None) -> None:
        """`chat_template`: a Jinja template replacing the checkpoint's (tokenizer_config.json
        or chat_template.jinja)."""
        # transformers warns at import that PyTorch is missing; we only use its tokenizers
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from transformers import AutoTokenizer

        path = Path(model_path)
        self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        if chat_template is not None:
            self._tok.chat_template = chat_template
        self.eos_token_ids = frozenset(_eos_ids(path, self._tok))
        self.eos_token = self._tok.eos_token
        self.bos_token = self._tok.bos_token
        self.vocab_size = len(self._tok)
        self.has_chat_template = bool(getattr(self._tok, "chat_template", None))

    @property
    def hf(self):
        """The underlying transformers tokenizer (for the API's tokenizer_info)."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each id decoded on its own (how OpenAI reports `tokens` in logprobs)."""
        return [self._tok.decode([i], skip_special_tokens=False) for i in ids]

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Render `messages` with the generation prompt and tokenize them."""
        if not self.has_chat_template:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
            return self.encode(text)
        try:
            out = self._tok.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        except Exception as exc:  # jinja errors: a template that rejects these messages
            raise ChatTemplateError(f"the chat template rejected the messages: {exc}") from exc
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)


def _eos_ids(path: Path, tok) -> set[int]:
    ids: set[int] = set()
    if tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    for name in ("config.json", "generation_config.json"):
        f = path / name
        if f.is_file():
            value = json.loads(f.read_text()).get("eos_token_id")
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list):
                ids.update(int(v) for v in value)
    return ids
