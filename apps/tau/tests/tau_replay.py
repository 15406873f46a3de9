"""A token engine that replays gold conversations (test double at the vLLM boundary).

It meets ``turnrl.tool_envs.protocol.TokenEngine``: given the prompt ids it finds the task
(by the user's first message) and how many assistant turns were already generated, and
returns the next gold assistant turn as token ids, rendered the way the chat template
renders assistant turns. Unit tests use it where a real vLLM engine would stand, so the
app's episode, user and reward path can be checked without starting an engine.
"""

from __future__ import annotations

import json
from typing import Any

from turnrl.tool_envs.chat import ChatTokenizer
from turnrl.tool_envs.protocol import Generation, SamplingParams


def assistant_text(message: dict[str, Any]) -> str:
    """An assistant message as the model would write it (content and <tool_call> blocks)."""
    parts = [message.get("content") or ""]
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        body = json.dumps({"name": fn["name"], "arguments": json.loads(fn["arguments"])})
        parts.append(f"<tool_call>\n{body}\n</tool_call>")
    return "\n".join(p for p in parts if p)


class ReplayEngine:
    """Replays the assistant turns of gold conversations, keyed by the opening user message."""

    def __init__(self, chat: ChatTokenizer, conversations: list[list[dict[str, Any]]]) -> None:
        self.chat = chat
        self.turns = {
            next(m["content"] for m in conv if m["role"] == "user"): [
                m for m in conv if m["role"] == "assistant"
            ]
            for conv in conversations
        }
        self.calls = 0

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, session_id: str | None = None
    ) -> Generation:
        self.calls += 1
        text = self.chat.decode(prompt_ids)
        opening = next(k for k in self.turns if k in text)
        done = text.count("<|im_start|>assistant") - 1
        ids = self.chat.encode(assistant_text(self.turns[opening][done]) + "<|im_end|>")
        return Generation(ids, [-0.1] * len(ids), "stop", self.chat.end_of_turn_id)
