"""Tokenizer wrapper: encoding, chat templates and token strings for one served model."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path


class ChatTemplateError(ValueError):
    """The model's chat template could not render the messages."""


_PROBE = "probe-7f3a"  # text a template must show when a message's content is a plain string


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
        self.vocab_size = len(self._tok)
        self.has_chat_template = bool(getattr(self._tok, "chat_template", None))
        # templates that show only lists of parts (SmolVLM's renders a plain string as nothing)
        # get every string content as one text part
        self.strings_as_parts = self.has_chat_template and not self._shows_strings()

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

    def apply_chat_template(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
    ) -> list[int]:
        """Render `messages` (and `tools`) with the generation prompt and tokenize them."""
        text = self.render_chat(messages, tools, template_kwargs)
        return self.encode(text, add_special_tokens=not self.has_chat_template)

    def render_chat(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
    ) -> str:
        """The prompt text: the chat template's `tools=` and extra variables (enable_thinking)."""
        if not self.has_chat_template:
            if tools:
                raise ChatTemplateError("this model has no chat template to show it 'tools'")
            return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        if self.strings_as_parts:
            messages = [
                {**m, "content": [{"type": "text", "text": m["content"]}]}
                if isinstance(m.get("content"), str)
                else m
                for m in messages
            ]
        try:
            return self._tok.apply_chat_template(
                messages,
                tools=tools or None,
                add_generation_prompt=True,
                tokenize=False,
                **(template_kwargs or {}),
            )
        except Exception as exc:  # jinja errors: a template that rejects these messages
            raise ChatTemplateError(f"the chat template rejected the messages: {exc}") from exc

    def _shows_strings(self) -> bool:
        """Whether the template shows a user message's plain-string content (a template that
        fails on the probe is taken to)."""
        try:
            text = self._tok.apply_chat_template(
                [{"role": "user", "content": _PROBE}], add_generation_prompt=True, tokenize=False
            )
        except Exception:  # jinja errors: the probe is not what this template takes
            return True
        return _PROBE in text

    @property
    def template_source(self) -> str:
        """The chat template's jinja source ('' without one)."""
        tpl = getattr(self._tok, "chat_template", None) or ""
        return tpl if isinstance(tpl, str) else " ".join(str(v) for v in dict(tpl).values())

    def special_token_id(self, text: str) -> int | None:
        """The id of `text` when it is one added (special or control) token, else None."""
        added = self._tok.get_added_vocab()
        return added.get(text)

    def decoder_keeping(self, keep: frozenset[int]) -> Callable[[Sequence[int]], str]:
        """A decode function that skips special tokens except `keep` (tool-call markers)."""
        if not keep:
            return self.decode
        special = frozenset(self._tok.all_special_ids) - keep

        def decode(ids: Sequence[int]) -> str:
            return self._tok.decode([i for i in ids if i not in special], skip_special_tokens=False)

        return decode


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
