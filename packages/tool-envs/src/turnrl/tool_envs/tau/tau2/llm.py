"""The LLM parts of a tau2 episode: the user simulator's prompt and the NL-assertion judge.

Both go through litellm (``pip install 'turnrl-tool-envs[litellm]'``) with the LLM user's
retries (:func:`turnrl.tool_envs.user_sim.complete`), so any provider or a local
OpenAI-compatible server (turnrl's router over the engines) can play either role.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from turnrl.rewards.tau2 import nl_judge_messages, parse_nl_verdicts
from turnrl.tool_envs.user_sim import LiteLLMUserConfig, UserUsage, _import_litellm, complete


def user_prompt(data_root: str | Path, with_tools: bool = False) -> str:
    """tau2's user-simulator system prompt template: its guidelines, then the scenario.

    ``data_root`` holds ``user_simulator/simulation_guidelines[_tools].md``; the result
    has an ``{instruction}`` placeholder (``LiteLLMUserConfig.system_prompt``) that the
    user simulator fills with the task's rendered scenario.
    """
    name = "simulation_guidelines_tools.md" if with_tools else "simulation_guidelines.md"
    path = Path(data_root) / "user_simulator" / name
    if not path.is_file():
        raise FileNotFoundError(f"missing tau2 user guidelines {path}")
    guidelines = path.read_text(encoding="utf-8").replace("{", "{{").replace("}", "}}")
    return f"{guidelines.strip()}\n\n<scenario>\n{{instruction}}\n</scenario>"


class LiteLLMJudge:
    """Judges a conversation's NL assertions with any litellm model (tau2: temperature 0).

    A failed call (after the retries) or an unreadable answer raises; the caller must not
    score such an episode as the policy's failure.
    """

    def __init__(self, config: LiteLLMUserConfig) -> None:
        self.config = config
        self._litellm = _import_litellm()
        self.usage = UserUsage()

    async def __call__(
        self, conversation: Sequence[dict[str, Any]], assertions: Sequence[str]
    ) -> tuple[bool, ...]:
        messages = nl_judge_messages(conversation, assertions)
        text = await complete(self._litellm, self.config, messages, self.usage)
        return parse_nl_verdicts(text, assertions)
