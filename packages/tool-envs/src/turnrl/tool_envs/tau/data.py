"""Tasks, domains, tool schemas and users of a tau run.

:class:`TauTaskConfig` says which tasks a run uses (the synthetic mini-retail domain
generated from a seed, tau-bench retail/airline data from ``tau_bench_dir``, or tau2-bench
data from ``tau2_dir``), how they split into train and held-out, and who plays the user
(the scripted customer of ``tau.gold``, or an LLM through litellm).
:func:`load_tasks_and_domain` builds them; :func:`user_factory` and :func:`judge` give the
episodes' user simulator and tau2's NL-assertion judge.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from turnrl.tool_envs.protocol import UserSimulator
from turnrl.tool_envs.tau import Task, TauDomain, load_tasks
from turnrl.tool_envs.tau import synth as tau_synth
from turnrl.tool_envs.tau.gold import TaskUser, gold_conversation, short_tool_schemas
from turnrl.tool_envs.tau.synth import TASK_KINDS
from turnrl.tool_envs.tau.tau2 import gold as tau2_gold
from turnrl.tool_envs.tau.tau2 import tasks as tau2_tasks
from turnrl.tool_envs.tau.tau2.domain import Tau2Domain, load_domain


@dataclass
class TauTaskConfig:
    """The task data of a tau run and its user simulator."""

    benchmark: str = field(default="tau", metadata={"flags": (("--benchmark", str),)})
    """tau (tau-bench from ``tau_bench_dir``, or the synthetic domain) or tau2 (tau2-bench
    from ``tau2_dir``: its train split trained, its test split held out)."""
    domain: str = field(default="retail", metadata={"flags": (("--domain", str),)})
    """retail or airline (real data), or synthetic (generated mini-retail); tau2: airline,
    retail or telecom (telecom needs ``user_model``: its user calls tools)."""
    tau2_dir: str | None = field(default=None, metadata={"flags": (("--tau2-dir", str),)})
    """tau2-bench data folder (airline/, retail/, telecom/, user_simulator/)."""
    judge_model: str | None = field(default=None, metadata={"flags": (("--judge-model", str),)})
    """tau2: litellm model judging NL assertions ('local': the engines); None leaves out the
    tasks whose reward they gate (the data step says how many)."""
    tau_bench_dir: str | None = field(default=None, metadata={"flags": (("--tau-bench-dir", str),)})
    """tau-bench data folder with <domain>/ subfolders; None: synthetic."""
    prompt_data: str | None = field(default=None, metadata={"flags": (("--prompt-data", str),)})
    """Task file for training; default <tau-bench-dir>/<domain>/tasks_<split>.jsonl."""
    input_key: str = field(
        default="index",
        metadata={
            "flags": (("--input-key", str),),
            "refused": "tasks are read by index from the tau-bench data",
        },
    )
    """Key of the task id in prompt records."""
    split: str = field(default="train", metadata={"flags": (("--split", str),)})
    """Task split to read (train, test, dev)."""
    task_start: int = field(default=0, metadata={"flags": (("--task-start", int),)})
    """First task index used."""
    task_end: int | None = field(default=None, metadata={"flags": (("--task-end", int),)})
    """One past the last task index used (None: all)."""
    synthetic_seed: int = 0
    """Seed of the synthetic domain."""
    synthetic_num_tasks: int = field(
        default=48, metadata={"flags": (("--synthetic-num-tasks", int),)}
    )
    """Tasks generated for the synthetic domain."""
    synthetic_num_users: int = field(
        default=24, metadata={"flags": (("--synthetic-num-users", int),)}
    )
    """Customers generated for the synthetic domain."""
    synthetic_kinds: list[str] = field(
        default_factory=lambda: ["status", "cancel", "address", "return", "exchange"],
        metadata={"flags": (("--synthetic-kinds", "list"),)},
    )
    """Task kinds kept from the synthetic generator (``tau.synth.TASK_KINDS``), each task
    about a distinct (kind, order)."""
    num_heldout: int = field(default=12, metadata={"flags": (("--num-heldout", int),)})
    """Tasks held out for evaluation (the last ones; tau2: the first N of the test split)."""
    policy_in_prompt: bool = field(
        default=True, metadata={"flags": (("--no-policy-in-prompt", "off"),)}
    )
    """The domain policy (wiki) as the system prompt; False puts a one-line system prompt
    (a tiny model cannot read the policy, and SFT steps are cheaper without it)."""
    user_model: str | None = field(default=None, metadata={"flags": (("--user-model", str),)})
    """litellm user model (e.g. openai/gpt-4o-mini, or local to use the engines); None: scripted."""
    user_retries: int = field(default=30, metadata={"env": "TAU_USER_LITELLM_RETRIES"})
    """User-simulator LLM retries (TAU_USER_LITELLM_RETRIES)."""
    user_retry_delay: float = field(default=2.0, metadata={"env": "TAU_USER_LITELLM_RETRY_DELAY"})
    """Seconds between retries (TAU_USER_LITELLM_RETRY_DELAY)."""

    def __post_init__(self) -> None:
        if self.benchmark not in ("tau", "tau2"):
            raise ValueError(f"benchmark must be tau or tau2, got {self.benchmark!r}")


SHORT_SYSTEM_PROMPT = "You are a retail customer service agent. Help the user with the tools."
"""System prompt in place of the policy when ``policy_in_prompt`` is off."""


@dataclass
class TaskData:
    """The domain and the tasks of a run."""

    domain: TauDomain | Tau2Domain
    """Data, tools and policy."""
    train: list[Any]
    """Tasks GRPO trains on (and SFT warms up on): tau-bench ``Task``s or ``Tau2Task``s."""
    heldout: list[Any]
    """Tasks only evaluated."""
    source: str
    """Where the data came from (for the summary)."""

    @property
    def system_prompt(self) -> str:
        """The agent's system prompt (what the environment puts first)."""
        if isinstance(self.domain, Tau2Domain):
            return self.domain.system_prompt
        return self.domain.wiki

    def conversation(self, task: Any) -> list[dict[str, Any]]:
        """``task`` solved by its gold actions, as the scripted user would answer it."""
        if isinstance(self.domain, Tau2Domain):
            return tau2_gold.gold_conversation(self.domain, task)
        return gold_conversation(self.domain, task, self.domain.wiki)


def _split(tasks: list[Task], num_heldout: int) -> tuple[list[Task], list[Task]]:
    if num_heldout < 0 or num_heldout >= len(tasks):
        raise ValueError(f"num_heldout must be in [0, {len(tasks)}), got {num_heldout}")
    cut = len(tasks) - num_heldout
    return tasks[:cut], tasks[cut:]


def load_tasks_and_domain(settings: TauTaskConfig) -> TaskData:
    """Build the run's domain and tasks.

    Raises:
        ValueError: an unknown domain, a synthetic run with a data folder, an empty task
            range or a bad held-out count.
        FileNotFoundError: the data or task file does not exist.
    """
    data = _load(settings)
    if settings.policy_in_prompt:
        return data
    if isinstance(data.domain, Tau2Domain):
        data.domain.policy = f"You are a {data.domain.name} customer service agent."
    else:
        data.domain.wiki = SHORT_SYSTEM_PROMPT
    return data


def _load(settings: TauTaskConfig) -> TaskData:
    if settings.benchmark == "tau2":
        return load_tau2(settings)
    if settings.domain == "synthetic":
        return synthetic_tasks(settings)
    if settings.domain not in ("retail", "airline"):
        raise ValueError(f"domain must be retail, airline or synthetic, got {settings.domain!r}")
    if not settings.tau_bench_dir:
        raise ValueError(f"domain {settings.domain!r} needs --tau-bench-dir")
    folder = Path(settings.tau_bench_dir) / settings.domain
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} not found (expected <tau-bench-dir>/{settings.domain})")
    domain = TauDomain.from_dir(settings.domain, folder)
    task_file = folder / f"tasks_{settings.split}.jsonl"
    if settings.prompt_data and Path(settings.prompt_data).is_file():
        task_file = Path(settings.prompt_data)
    if not task_file.is_file():
        raise FileNotFoundError(f"task file {task_file} not found")
    tasks = load_tasks(task_file)[settings.task_start : settings.task_end]
    if not tasks:
        raise ValueError(f"no tasks in {task_file}[{settings.task_start}:{settings.task_end}]")
    train, heldout = _split(tasks, settings.num_heldout)
    return TaskData(domain, train, heldout, f"tau-bench {settings.domain} ({task_file.name})")


def load_tau2(settings: TauTaskConfig) -> TaskData:
    """tau2-bench: ``--split`` (train) trained, the test split (its first ``num_heldout``, or
    all with 0) held out; tasks gated by NL assertions need ``--judge-model``."""
    if settings.tau2_dir is None:
        raise ValueError("--benchmark tau2 needs --tau2-dir (the tau2-bench data folder)")
    if settings.domain not in ("airline", "retail", "telecom"):
        raise ValueError(
            f"--benchmark tau2: domain must be airline, retail or telecom, got {settings.domain!r}"
        )
    if settings.domain == "telecom" and settings.user_model is None:
        raise ValueError(
            "--benchmark tau2 --domain telecom needs --user-model: its user acts on the phone "
            "through tools, which the scripted user cannot"
        )
    if settings.split == "test":
        raise ValueError(
            "--benchmark tau2 --split test: the test split is held out; train on train"
        )
    folder = Path(settings.tau2_dir) / settings.domain
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} not found (expected <tau2-dir>/{settings.domain})")
    domain = load_domain(settings.domain, folder)
    train = tau2_tasks.load_tasks(folder, settings.split)[settings.task_start : settings.task_end]
    heldout = tau2_tasks.load_tasks(folder, "test")[: settings.num_heldout or None]
    note = ""
    if settings.judge_model is None:
        judged = [t for t in train + heldout if t.needs_judge]
        train = [t for t in train if not t.needs_judge]
        heldout = [t for t in heldout if not t.needs_judge]
        if judged:
            note = f"; {len(judged)} tasks gated by NL assertions left out (no --judge-model)"
    if not train:
        raise ValueError(f"no tau2 {settings.domain} tasks to train on{note}")
    label = f"tau2-bench {settings.domain} (split {settings.split}; held out: test{note})"
    return TaskData(domain, train, heldout, label)


def synthetic_tasks(settings: TauTaskConfig) -> TaskData:
    """The generated mini-retail domain with ``synthetic_num_tasks`` tasks of the chosen kinds.

    With every kind, the generator's tasks as drawn. With a subset, the chosen kinds from
    a longer draw (one task per kind and order, so no held-out task repeats a training
    one), interleaved kind by kind.

    Raises:
        ValueError: an unknown kind, or too few distinct tasks of those kinds.
    """
    kinds = list(settings.synthetic_kinds)
    unknown = sorted(set(kinds) - set(TASK_KINDS))
    if unknown or not kinds:
        raise ValueError(f"synthetic_kinds must be among {sorted(TASK_KINDS)}, got {kinds}")
    # Ordered (not a set): the interleaving below, hence the train/held-out split and the SFT
    # data order, must not depend on PYTHONHASHSEED.
    wanted = list(dict.fromkeys(TASK_KINDS[k] for k in kinds))
    n = settings.synthetic_num_tasks
    draw = n if len(wanted) == len(TASK_KINDS) else 6 * n
    generated = tau_synth.generate(settings.synthetic_seed, settings.synthetic_num_users, draw)
    buckets: dict[str, list[Task]] = {name: [] for name in wanted}
    seen = set()
    for task in generated.tasks:
        name = task.actions[-1].name
        key = (name, task.actions[1].kwargs.get("order_id"))
        if name in wanted and (len(wanted) == len(TASK_KINDS) or key not in seen):
            seen.add(key)
            buckets[name].append(task)
    # Round-robin over the kinds, so training and held-out tasks mix them evenly.
    tasks = [
        t for group in itertools.zip_longest(*buckets.values()) for t in group if t is not None
    ]
    if len(wanted) == len(TASK_KINDS):  # every kind: the generator's own order
        tasks = [t for t in generated.tasks if t.actions[-1].name in wanted]
    if len(tasks) < n:
        raise ValueError(
            f"only {len(tasks)} distinct synthetic tasks of kinds {kinds}; "
            "raise synthetic_num_users or lower synthetic_num_tasks"
        )
    train, heldout = _split(tasks[:n], settings.num_heldout)
    label = f"synthetic mini-retail (seed {settings.synthetic_seed}, {'+'.join(kinds)})"
    return TaskData(generated.domain(), train, heldout, label)


def extra_store_conversations(settings: TauTaskConfig, stores: int) -> list[list[dict[str, Any]]]:
    """Gold conversations of ``stores`` other synthetic stores (seeds after the run's own).

    Each store has its own customers, orders and tasks of the run's kinds (every task of it,
    none held out), so none of these conversations is about a held-out order. The system
    prompt is the run's (the policy, or the short prompt).
    """
    return [c for offset in range(1, stores + 1) for c in store_conversations(settings, offset)]


def store_conversations(settings: TauTaskConfig, offset: int) -> list[list[dict[str, Any]]]:
    """Gold conversations of the synthetic store ``offset`` seeds after the run's own."""
    other = dataclasses.replace(
        settings, synthetic_seed=settings.synthetic_seed + 1000 * offset, num_heldout=0
    )
    data = load_tasks_and_domain(other)
    return [data.conversation(t) for t in data.train]


def tool_schemas(data: TaskData, short: bool, in_prompt: bool = True) -> list[dict[str, Any]]:
    """Tools shown to the model: the synthetic domain shows only those its tasks use; none
    when ``in_prompt`` is off (the model calls the domain's tools all the same)."""
    if not in_prompt:
        return []
    schemas = data.domain.schemas
    if data.source.startswith("synthetic"):
        used = {a.name for t in data.train + data.heldout for a in t.actions}
        used.add("transfer_to_human_agents")
        schemas = [s for s in schemas if s["function"]["name"] in used]
    return short_tool_schemas(schemas) if short else list(schemas)


def _llm(settings: TauTaskConfig, model: str, engine_urls: Sequence[str], **extra: Any) -> Any:
    """litellm settings for ``model`` ('local': the policy engines, as vime does)."""
    from turnrl.tool_envs.user_sim import LiteLLMUserConfig

    api_base = None
    if model == "local":
        model, api_base = "openai/policy", f"{engine_urls[0]}/v1"
    return LiteLLMUserConfig(
        model=model,
        api_base=api_base,
        max_retries=settings.user_retries,
        backoff_s=settings.user_retry_delay,
        **extra,
    )


def user_factory(
    settings: TauTaskConfig, engine_urls: Sequence[str]
) -> Callable[[], UserSimulator]:
    """Scripted users by default; an LLM user through litellm with ``user_model``."""
    if settings.user_model is None:
        return TaskUser
    from turnrl.tool_envs.user_sim import LiteLLMUser

    config = _llm(settings, settings.user_model, engine_urls)
    if settings.benchmark == "tau2" and settings.tau2_dir:  # tau2's own user guidelines
        from turnrl.tool_envs.tau.tau2.llm import user_prompt

        config.system_prompt = user_prompt(
            settings.tau2_dir, with_tools=settings.domain == "telecom"
        )
    return lambda: LiteLLMUser(config)


def engine_args(settings: TauTaskConfig, given: Sequence[str]) -> list[str]:
    """Engine arguments the task setting needs beyond ``given``: engines that play tau2
    telecom's user, who calls the phone's tools, must parse tool calls on their chat route
    (Qwen3 writes hermes-style ``<tool_call>`` blocks)."""
    extra: list[str] = []
    if (
        settings.user_model == "local"
        and settings.benchmark == "tau2"
        and settings.domain == "telecom"
    ):
        if "--enable-auto-tool-choice" not in given:
            extra.append("--enable-auto-tool-choice")
        if not any(a.startswith("--tool-call-parser") for a in given):
            extra += ["--tool-call-parser", "hermes"]
    return extra


def judge(settings: TauTaskConfig, engine_urls: Sequence[str]) -> Any:
    """tau2's NL-assertion judge (``judge_model``; ``local``: the engines), or None."""
    if settings.benchmark != "tau2" or settings.judge_model is None:
        return None
    from turnrl.tool_envs.tau.tau2.llm import LiteLLMJudge

    return LiteLLMJudge(_llm(settings, settings.judge_model, engine_urls, max_tokens=2048))
