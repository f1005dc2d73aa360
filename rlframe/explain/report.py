"""The whole report of `rlframe explain`: `rlframe train`'s launch checks give the plan, the sections follow."""

from __future__ import annotations

import json

from rlframe.batch_plan import ModelShape
from rlframe.config.key_status import key_statuses, launch_warnings
from rlframe.config.secrets import find_secrets
from rlframe.explain.formatting import (
    attention_line,
    format_agents,
    format_algorithm,
    format_keys,
    format_plan,
    format_pools,
    format_simulation,
    user_set,
    vision_lines,
)
from rlframe.explain.simulation import sequence_lengths, simulate
from rlframe.trainer.async_plan import make_async_plan


def explain(
    overrides: list[str], lengths: str | None = None, fmt: str = "text", seed: int = 0, plan_only: bool = False
) -> str:
    """The whole report for `rlframe explain`; raises ValueError (the trainer's message) on a bad config.

    It runs the trainer's launch checks, in the same order, so the verdict is `rlframe train`'s.
    `plan_only` skips what needs files (model weights, device, datasets): for planning a run elsewhere.
    """
    from rlframe.trainer.main_ppo import check_config, load_data_and_rewards

    cfg, resolved, model, plan = check_config(overrides, check_files=not plan_only)
    secrets = find_secrets(cfg)  # the report and the data's errors show values and paths: never a secret one
    if not plan_only:
        with secrets.hidden_in_errors():
            load_data_and_rewards(resolved)
    model_path = resolved.actor_rollout_ref.model.path
    rows = key_statuses(cfg)
    warnings = launch_warnings(cfg, overrides)
    pools = make_async_plan(resolved, plan)  # None under trainer.v1.trainer_mode=sync
    sim = source = None
    if lengths is not None:
        seqlens, source = sequence_lengths(lengths, plan, seed)
        sim = simulate(plan, seqlens, None if model is None else model.hidden_size)
    if fmt == "json":
        report = json.dumps(
            {
                "plan": plan.to_dict(),
                "model": None if model is None else {"path": model_path, **_asdict(model)},
                "keys": [
                    {"key": r.key, "in_effect": r.in_effect, "reason": r.reason, "set": user_set(r.key, overrides)}
                    for r in rows
                ],
                "warnings": warnings,
                "simulation": None if sim is None else {"lengths": source, **sim},
                **({} if pools is None else {"async": pools.to_dict()}),
            },
            indent=2,
        )
        return secrets.scrub(report)
    model_line = (
        f"model     {model_path}: hidden_size {model.hidden_size}, heads {model.num_attention_heads}, "
        f"kv heads {model.num_key_value_heads}"
        if model
        else f"model     {model_path}: no config.json here, head checks skipped"
    )
    parts = [
        _rule("batch plan"),
        model_line,
        attention_line(resolved),
        *vision_lines(model_path, cfg),
        format_plan(plan),
    ]
    agents = format_agents(cfg, plan)
    if agents:
        parts += [_rule("agent loop"), agents]
    if pools is not None:
        parts += [_rule("pools and staleness"), format_pools(pools)]
    parts += [_rule("algorithm"), format_algorithm(cfg)]
    parts += [_rule("keys"), format_keys(cfg, rows, overrides)]
    if warnings:
        parts += [_rule("warnings"), "\n".join(warnings)]
    if sim is not None:
        parts += [_rule("simulation"), format_simulation(sim, source)]
    return secrets.scrub("\n".join(parts).lstrip("\n"))


def _asdict(model: ModelShape) -> dict:
    from dataclasses import asdict

    return asdict(model)


def _rule(title: str) -> str:
    return f"\n── {title} " + "─" * max(3, 72 - len(title))
