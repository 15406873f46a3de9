"""Chat rendering and tokenization: a model's tokenizer plus its Jinja chat template.

:class:`ChatTokenizer` loads a Hugging Face tokenizer folder (``tokenizer.json`` and
``tokenizer_config.json``, optionally ``chat_template.jinja``) with the ``tokenizers``
library and renders conversations with ``jinja2`` the way ``transformers``'
``apply_chat_template`` does (same sandbox, ``tojson`` filter, ``raise_exception``), so
neither ``transformers`` nor ``torch`` is needed.

Besides whole-conversation rendering it computes **deltas**: the text that follows a
finished assistant turn when new messages (tool results, a user reply) are appended.
The delta starts right after the end-of-turn token (``<|im_end|>``) that closes the
history, so it holds the template's separator (``"\\n"``), the new messages and the next
generation prompt — exactly what must follow the engine's own tokens. It is located by
counting end-of-turn tokens, which stays correct when a template re-renders earlier
turns differently once more messages follow (Qwen3 drops ``<think>`` blocks of earlier
turns and adds an empty one to a final assistant turn).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from turnrl.tool_envs.protocol import Message

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


class ChatTemplateError(ValueError):
    """The chat template failed to render a conversation (or called ``raise_exception``)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # The same JSON the transformers chat environment emits (not jinja's HTML-safe one).
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _token_content(entry: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(entry, dict):
        return entry.get("content")
    return entry if isinstance(entry, str) else None


def _select_template(raw: Any) -> str:
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return str(named["default"])
    raise ValueError("tokenizer_config.json has no usable chat_template (string or 'default')")


@dataclass
class ChatTokenizer:
    """A tokenizer and the chat template that renders conversations for it."""

    tokenizer: Tokenizer
    """The fast BPE tokenizer (``tokenizers.Tokenizer``)."""
    chat_template: str
    """Jinja source of the chat template."""
    end_of_turn: str = "<|im_end|>"
    """The token that closes every message (ChatML's ``<|im_end|>``); engines stop on it."""
    special_tokens: dict[str, str] | None = None
    """``bos_token``/``eos_token``/... strings passed to the template, as transformers does."""
    think_start: str = "<think>"
    """The token opening a reasoning block (used to explain prefix mismatches)."""

    def __post_init__(self) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(self.chat_template)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from exc
        if self.tokenizer.token_to_id(self.end_of_turn) is None:
            raise ValueError(f"end-of-turn token {self.end_of_turn!r} is not in the vocabulary")

    @classmethod
    def from_dir(cls, path: str | Path, chat_template: str | None = None) -> ChatTokenizer:
        """Load a Hugging Face tokenizer folder.

        Args:
            path: Folder with ``tokenizer.json`` and ``tokenizer_config.json`` (and optionally
                ``chat_template.jinja``, which wins over the config's ``chat_template``).
            chat_template: Jinja source overriding the folder's template.

        Raises:
            FileNotFoundError: A required file is missing.
            ValueError: No chat template, or the end-of-turn token is unknown.
        """
        folder = Path(path)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if not (folder / name).is_file():
                raise FileNotFoundError(f"{folder / name} not found (not a tokenizer folder?)")
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        if chat_template is None:
            jinja_file = folder / "chat_template.jinja"
            if jinja_file.is_file():
                chat_template = jinja_file.read_text(encoding="utf-8")
            elif "chat_template" in config:
                chat_template = _select_template(config["chat_template"])
            else:
                raise ValueError(f"{folder} has no chat template; pass chat_template=")
        specials = {k: v for k in _SPECIAL_TOKEN_KEYS if (v := _token_content(config.get(k)))}
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        end_of_turn = specials.get("eos_token", "<|im_end|>")
        if tokenizer.token_to_id("<|im_end|>") is not None:
            end_of_turn = "<|im_end|>"  # ChatML: turns end with <|im_end|> whatever eos says
        return cls(tokenizer, chat_template, end_of_turn=end_of_turn, special_tokens=specials)

    # -- tokens ---------------------------------------------------------------------------

    @property
    def end_of_turn_id(self) -> int:
        """Id of the end-of-turn token (``<|im_end|>``)."""
        token_id = self.tokenizer.token_to_id(self.end_of_turn)
        assert token_id is not None  # checked in __post_init__
        return int(token_id)

    @property
    def stop_token_ids(self) -> list[int]:
        """Token ids a generation should stop on: end of turn, and eos when it differs."""
        ids = [self.end_of_turn_id]
        eos = (self.special_tokens or {}).get("eos_token")
        eos_id = self.tokenizer.token_to_id(eos) if eos else None
        if eos_id is not None and eos_id not in ids:
            ids.append(int(eos_id))
        return ids

    def token_id(self, token: str) -> int:
        """The id of one vocabulary token; ``KeyError`` when it is not a single token."""
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise KeyError(f"{token!r} is not a token of this vocabulary")
        return int(token_id)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in it (``<|im_start|>``) map to their ids."""
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def encode_unlocked(self, text: str) -> list[int]:
        """:meth:`encode` through ``encode_batch``, which releases the GIL while it runs, so
        worker threads encode while the event loop goes on (``encode`` holds it). It counts as
        the tokenizers' own parallelism: a process forked after it gets a warning."""
        return list(self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (special tokens kept unless ``skip_special_tokens``)."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    # -- rendering ------------------------------------------------------------------------

    def render(
        self,
        messages: Sequence[Message],
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation to text with the chat template.

        Args:
            messages: OpenAI-format messages.
            tools: OpenAI function schemas; ``None`` or empty renders no tool section.
            add_generation_prompt: Append the prompt that opens the assistant's next turn.
            **template_kwargs: Extra template variables (e.g. ``enable_thinking=False``).

        Raises:
            ChatTemplateError: The template rejected the conversation.
        """
        if not messages:
            raise ValueError("cannot render an empty conversation")
        variables = dict(self.special_tokens or {})
        variables.update(template_kwargs)
        try:
            return self._template.render(
                messages=list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, AttributeError) as exc:
            raise ChatTemplateError(f"chat template failed to render: {exc}") from exc

    def render_ids(
        self,
        messages: Sequence[Message],
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of :meth:`render`."""
        return self.encode(self.render(messages, tools, add_generation_prompt, **template_kwargs))

    def render_delta(
        self,
        history: Sequence[Message],
        new_messages: Sequence[Message],
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The text that follows ``history``'s last end-of-turn token once ``new_messages`` are added.

        ``history`` must end with a closed message (normally the assistant turn the engine
        just finished with ``<|im_end|>``). The result starts with the template's separator
        after that token and ends with the generation prompt of the next assistant turn.

        Raises:
            ValueError: ``new_messages`` is empty, or the template does not close the history
                with the end-of-turn token.
        """
        if not new_messages:
            raise ValueError("render_delta needs at least one new message")
        before = self.render(history, tools, False, **template_kwargs)
        after = self.render(
            [*history, *new_messages], tools, add_generation_prompt, **template_kwargs
        )
        closed = before.count(self.end_of_turn)
        if closed == 0 or not before.rstrip().endswith(self.end_of_turn):
            raise ValueError(
                f"the template does not end the history with {self.end_of_turn!r}; "
                "a delta can only follow a closed turn"
            )
        cut = -len(self.end_of_turn)
        for _ in range(closed):
            cut = after.find(self.end_of_turn, cut + len(self.end_of_turn))
            if cut < 0:
                raise ValueError("the template renders fewer turns once new messages are added")
        return after[cut + len(self.end_of_turn) :]
