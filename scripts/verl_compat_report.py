"""How many of verl's example command lines rlframe's launch checks take: per script and per key use.

    python scripts/verl_compat_report.py OUT.json [--corpus tests/assets/verl_examples] [--only NAME ...]
        [--verl-config VERL_WHEEL/verl/trainer/config]

Each corpus file (see tests/assets/verl_examples/README.md) is one verl script's Hydra overrides.
A script is TAKEN WHOLE when `rlframe explain <its overrides>` exits 0, or fails only on a value whose
message says a GPU or an engine is missing here. Each key use (one override) is then classified:

  accepted          explain takes it (in effect as far as explain can tell)
  warned            explain takes it and warns that it has no effect in this config, saying why
  refused_by_value  explain refuses it with a message that names the key
  unknown           refused as a key no rlframe component reads (the loader's unknown-key message)
  added_unread      `+key`/`++key` that explain lets through although rlframe's config lacks the key
                    (and it is not under an open `{}` section): added, and nothing reads it
  unchecked         explain stopped on a value the script did not set (one of rlframe's defaults),
                    so its later checks never saw these keys

Taken key uses are accepted + warned + refused_by_value (honoured, or refused with a reason).

Refusals are found by peeling: the refused override (the first config key explain's message names,
when the script sets it) is set aside and explain runs again on the rest, so one script can show
several; the keys after a peeled one are checked against rlframe's default for it. Every explain call
is the `rlframe explain` entry itself, in-process (no Ray, no model load). Model folders and data
files the scripts name are not on this machine: the checks see stand-ins (`with_stand_ins`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shutil
import sys
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

CORPUS = Path(__file__).resolve().parent.parent / "tests" / "assets" / "verl_examples"
# Stand-ins for what this machine lacks (the scripts name hub models and data files of their own
# cluster): a model folder whose heads every tp/sp degree of the corpus divides, and a built-in task.
MODEL_KEYS = re.compile(r"(^|\.)(model\.path|tokenizer_path|input_tokenizer|tokenizer)$")
REWARD_MODEL_KEY = re.compile(r"^(reward_model\.model\.path|reward\.reward_model\.model_path)$")
DATA_KEYS = re.compile(r"^data\.(train_files|val_files)$")
DATA_BATCH_KEY = re.compile(r"^data\.\w*batch_size$")  # train, gen (DAPO) and val batch sizes
STAND_IN_HEADS = {"num_attention_heads": 64, "num_key_value_heads": 16, "hidden_size": 1024}
VERL_TRAIN_BATCH_SIZE = 1024  # verl 0.9.1's data.train_batch_size, for a script that does not set it
REWARD_FILE_KEY = re.compile(r"^(reward\.)?custom_reward_function\.path$")
TOOL_CONFIG_KEY = re.compile(r"^actor_rollout_ref\.rollout\.multi_turn\.tool_config_path$")
# The tool class each of verl's tool-config files (in its repository) declares: the stand-in declares the same
# class, so the launch checks meet what the script would load (rlframe maps verl's GSM8K demo tool and
# refuses the others by name).
VERL_TOOL_CLASSES = {
    "gsm8k_tool_config.yaml": "verl.tools.gsm8k_tool.Gsm8kTool",
    "geo3k_tool_config.yaml": "verl.tools.geo3k_tool.Geo3kTool",
    "search_tool_config.yaml": "verl.tools.search_tool.SearchTool",
    "sandbox_fusion_tool_config.yaml": "verl.tools.sandbox_fusion_tools.SandboxFusionTool",
}
# A failure the rule accepts: the config is fine, this machine lacks a GPU or an engine.
NEEDS_GPU_OR_ENGINE = re.compile(r"no CUDA device|CUDA is not available|no GPU|not installed|No module named", re.I)
# Also accepted: the config is fine, its vLLM engines need more memory than this machine has (verl's scripts are
# sized for GPU nodes). explain checks that after every config check, so the script's other keys were all taken.
NEEDS_LARGER_MACHINE = re.compile(r"more than this machine gives each|but the machine has \S+ GiB available now")
# The loader's refusals of a key no component reads (a typo, or a verl key rlframe lacks): "unknown".
UNKNOWN_KEY = re.compile(r"unknown config key '([^']+)'|(\S+) is not a config key")
WARNING_KEY = re.compile(r"warning: ([^=\s]+)=")
DOTTED = re.compile(r"[A-Za-z_][\w]*(?:\.[\w]+)+")

# The ten defaults issue 11 names, with verl 0.9.1's value as the issue states it (the same values as
# rlframe/config/verl_defaults.json, read from verl's wheel), and when a script's omission of the key
# matters (verl's semantics: gae trains a critic; token budgets need dynamic bsz, and the critic's
# use_dynamic_bsz follows the actor's).
VERL_DEFAULTS = {
    "actor_rollout_ref.rollout.n": ("1", "always"),
    "algorithm.adv_estimator": ("gae", "always"),
    "actor_rollout_ref.rollout.enforce_eager": ("False", "always"),
    "actor_rollout_ref.rollout.calculate_log_probs": ("True", "always"),
    "data.filter_overlong_prompts": ("False", "always"),
    "actor_rollout_ref.model.enable_gradient_checkpointing": ("True", "always"),
    "critic.model.enable_gradient_checkpointing": ("True", "critic"),
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": ("16384", "actor dynamic bsz"),
    "critic.ppo_max_token_len_per_gpu": ("32768", "critic dynamic bsz"),
    "data.return_raw_chat": ("True", "always"),
}


@dataclass
class Example:
    """One corpus file: the verl script it came from, its Hydra options and its overrides."""

    name: str
    source: str
    hydra_options: str
    overrides: list[str]


@dataclass
class KeyUse:
    """One override of one script and what the launch checks made of it."""

    override: str
    key: str
    status: str
    message: str = ""


@dataclass
class ScriptResult:
    """The verdict on one script, explain's first message, and each of its key uses."""

    name: str
    source: str
    verdict: str  # taken | taken (needs GPU/engine) | taken (needs a larger machine) | refused
    first_message: str
    hydra_options: str
    stand_ins: list[str] = field(default_factory=list)
    key_uses: list[KeyUse] = field(default_factory=list)

    @property
    def taken_whole(self) -> bool:
        return self.verdict != "refused"


def read_example(path: Path) -> Example:
    """Parse one corpus file (comment header, then one override per line)."""
    header, overrides = {}, []
    for line in path.read_text().splitlines():
        if line.startswith("# ") and ": " in line:
            name, value = line[2:].split(": ", 1)
            header.setdefault(name, value)
        elif line.strip() and not line.startswith("#"):
            overrides.append(line)
    return Example(path.stem, header.get("source", ""), header.get("hydra options", ""), overrides)


def read_corpus(folder: Path, only: list[str] | None = None) -> list[Example]:
    """All corpus files in name order (or those named in `only`)."""
    paths = sorted(folder.glob("*.txt"))
    if only:
        paths = [p for p in paths if p.stem in only]
        missing = set(only) - {p.stem for p in paths}
        if missing:
            raise ValueError(f"not in the corpus {folder}: {', '.join(sorted(missing))}")
    return [read_example(p) for p in paths]


def make_stand_in_model(folder: Path, builtin: str = "builtin://tiny") -> str:
    """A tiny built-in model's files with a config.json of 64 heads / 16 kv heads (divisible by every
    tp and sp degree in the corpus). The launch checks read only config.json (and a vision-language model's
    preprocessor_config.json); nothing loads the weights. A vision-language config keeps its language model's
    shape under text_config."""
    from rlframe.models.builtin import resolve_model_path

    shutil.copytree(resolve_model_path(builtin), folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    (config["text_config"] if "text_config" in config else config).update(STAND_IN_HEADS)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return str(folder)


def make_stand_in_reward_model(model: str, folder: Path) -> str:
    """The stand-in model as a one-label sequence classifier: `lm_head` swapped for a `score` head of the
    stand-in's hidden size (the launch checks compare the head's names and shapes in the safetensors header)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, folder, dirs_exist_ok=True)
    weights = {name: w for name, w in load_file(folder / "model.safetensors").items() if name != "lm_head.weight"}
    weights["score.weight"] = torch.zeros(1, STAND_IN_HEADS["hidden_size"])
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return str(folder)


def stand_in_rows(overrides: list[str]) -> int:
    """Twice the script's largest `data.*batch_size` (verl's train batch where it sets none): the launch checks
    compare the data set's size with the batches, and every row is tokenized, so no more than that."""
    sizes = [VERL_TRAIN_BATCH_SIZE]
    for override in overrides:
        key, _, value = override.partition("=")
        if DATA_BATCH_KEY.match(bare_key(key)) and value.isdigit():
            sizes.append(int(value))
    return 2 * max(sizes)


def make_stand_in_data(folder: Path, rows: int) -> str:
    """A parquet file in verl's schema: `rows` rows of the built-in `countdown_add` task (made once per size)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlframe.data.builtin_tasks import countdown_add_rows

    path = folder / f"stand_in_data_{rows}.parquet"
    if not path.exists():
        pq.write_table(pa.Table.from_pylist(countdown_add_rows("train", rows, 0)), path)
    return str(path)


def make_stand_in_reward(folder: Path, overrides: list[str]) -> str:
    """A reward file defining the function the script names (`custom_reward_function.name`, else verl's
    default `compute_score`): the launch checks import the file and look the function up."""
    names = [o.partition("=")[2] for o in overrides if bare_key(o).endswith("custom_reward_function.name")]
    name = names[-1] if names and names[-1] else "compute_score"
    path = folder / f"stand_in_reward_{name}.py"
    path.write_text(f"def {name}(data_source, solution_str, ground_truth, extra_info=None, **_):\n    return 0.0\n")
    return str(path)


def make_stand_in_tools(folder: Path, value: str) -> str:
    """A tool config declaring the class verl's file of that name declares (`VERL_TOOL_CLASSES`)."""
    name = Path(value).name
    if name not in VERL_TOOL_CLASSES:
        return value  # unknown file: the checks see the script's path (and say it is missing)
    path = folder / f"stand_in_{name}"
    path.write_text(f"tools:\n  - class_name: {VERL_TOOL_CLASSES[name]}\n    config: {{type: native}}\n")
    return str(path)


@dataclass(frozen=True)
class StandIns:
    """Files the scripts name that are not on this machine, replaced by ones the launch checks can read."""

    folder: Path
    model: str
    reward_model: str
    vision_model: str  # for a script with images (data.image_key): the tiny Qwen2-VL, so the images' checks run


def with_stand_ins(overrides: list[str], stand_ins: StandIns) -> tuple[list[str], list[str]]:
    """Overrides with model folders, data files and reward files that are not on this machine replaced;
    what was."""
    out, replaced = [], []
    with_images = any(o.partition("=")[0].lstrip("+~") == "data.image_key" for o in overrides)
    model = stand_ins.vision_model if with_images else stand_ins.model
    for override in overrides:
        key, _, value = override.partition("=")
        bare = key.lstrip("+~")
        if value and value.lower() not in ("null", "none") and not Path(value).exists():
            if REWARD_MODEL_KEY.match(bare):
                override = f"{key}={stand_ins.reward_model}"
            elif MODEL_KEYS.search(bare):
                override = f"{key}={model}"
            elif DATA_KEYS.match(bare):  # the corpus writes a built-in task where the script named its files
                override = f"{key}={make_stand_in_data(stand_ins.folder, stand_in_rows(overrides))}"
            elif REWARD_FILE_KEY.match(bare):
                override = f"{key}={make_stand_in_reward(stand_ins.folder, overrides)}"
            elif TOOL_CONFIG_KEY.match(bare):
                override = f"{key}={make_stand_in_tools(stand_ins.folder, value)}"
        if override != f"{key}={value}" and "=" in override:
            replaced.append(f"{bare}: {value} -> {override.partition('=')[2]}")
        out.append(override)
    return out, replaced


def bare_key(override: str) -> str:
    """`+a.b=1` -> `a.b`; `~a.b` -> `a.b`."""
    return override.split("=", 1)[0].lstrip("+~").split("@", 1)[0]


@dataclass(frozen=True)
class ConfigKeys:
    """The paths of rlframe's default config: every leaf and section, and the empty (open) sections."""

    paths: frozenset[str]
    open_sections: frozenset[str]  # `{}` in the YAML, e.g. engine kwargs handed on as they are

    def reads(self, key: str) -> bool:
        """Whether a key set with `+key=` lands in the config's own keys or under an open section."""
        parts = key.split(".")
        return key in self.paths or any(".".join(parts[:i]) in self.open_sections for i in range(1, len(parts)))


def config_keys() -> ConfigKeys:
    """Every leaf and section path of rlframe's default config (what an override may name)."""
    from omegaconf import OmegaConf

    from rlframe.config.loader import leaves, load_config

    paths, open_sections = set(), set()
    for leaf, value in leaves(OmegaConf.to_container(load_config([]), resolve=False)).items():
        parts = leaf.split(".")
        paths.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        if value == {}:
            open_sections.add(leaf)
    return ConfigKeys(frozenset(paths), frozenset(open_sections))


def run_explain(overrides: list[str]) -> tuple[int, str, list[str]]:
    """Exit status, error message and warnings of `rlframe explain --format json <overrides>`."""
    from rlframe.explain.cli import main as explain_main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = explain_main([*overrides, "--format", "json"])
        except Exception as exc:  # an uncaught error is itself a finding: the user gets a traceback
            return 3, f"crash: {type(exc).__name__}: {exc}", []
    if status != 0:
        return status, err.getvalue().strip().removeprefix("error: "), []
    return 0, "", json.loads(out.getvalue()).get("warnings", [])


def charged_key(message: str, overrides: list[str], known: set[str]) -> int | None:
    """Index of the override a refusal is charged to: the first config key the message names, when
    the script sets it (its last setting wins, as in Hydra); None when that key is one the script left
    at rlframe's default, or the message names no key."""
    script_keys = [bare_key(o) for o in overrides]
    for match in DOTTED.finditer(message):
        name = match.group(0).rstrip(".")
        if name in script_keys:
            return len(script_keys) - 1 - script_keys[::-1].index(name)
        if name in known:
            return None
    return None


def classify_keys(overrides: list[str], first: tuple[int, str, list[str]], known: ConfigKeys) -> list[KeyUse]:
    """Per key use, by peeling: explain runs, the override its message is charged to is set aside with
    that message, and explain runs again on the rest, until it passes or the message names no key of
    the script. `first` is explain's result on all of `overrides`."""
    uses = [KeyUse(override, bare_key(override), "accepted") for override in overrides]
    live = list(uses)
    status, message, warnings = first
    while status != 0 and not NEEDS_LARGER_MACHINE.search(message):
        index = charged_key(message, [u.override for u in live], known.paths)
        if index is None:  # a refusal of a value the script did not set: the rest stay unchecked
            for use in live:
                use.status, use.message = "unchecked", message
            return uses
        use = live.pop(index)
        use.status = "unknown" if UNKNOWN_KEY.search(message) else "refused_by_value"
        use.message = message
        status, message, warnings = run_explain([u.override for u in live])
    for use in live:
        warning = next(
            (w for w in warnings if WARNING_KEY.search(w) and WARNING_KEY.search(w).group(1) == use.key), None
        )
        if warning:
            use.status, use.message = "warned", warning
        elif use.override.startswith("+") and not known.reads(use.key):
            use.status = "added_unread"
    return uses


def check_script(example: Example, known: ConfigKeys, stand_ins: StandIns) -> ScriptResult:
    """Explain with the script's overrides (stand-ins for missing models and files), then per key use."""
    overrides, replaced = with_stand_ins(example.overrides, stand_ins)
    first = run_explain(overrides)
    status, message, _ = first
    if status == 0:
        verdict = "taken"
    elif NEEDS_GPU_OR_ENGINE.search(message) and not UNKNOWN_KEY.search(message):
        verdict = "taken (needs GPU/engine)"
    elif NEEDS_LARGER_MACHINE.search(message):
        verdict = "taken (needs a larger machine)"
    else:
        verdict = "refused"
    result = ScriptResult(example.name, example.source, verdict, message, example.hydra_options, replaced)
    result.key_uses = classify_keys(overrides, first, known)
    for use, written in zip(result.key_uses, example.overrides):
        use.override = written  # report the key use as the script wrote it
    return result


def _truthy(value: str | None) -> bool:
    return str(value).strip("'\"").lower() == "true"


def default_reliance(examples: list[Example]) -> list[dict]:
    """For each of the ten defaults: rlframe's value now, verl's, and how many scripts omit the key."""
    from omegaconf import OmegaConf

    from rlframe.config.loader import leaves, load_config

    ours = leaves(OmegaConf.to_container(load_config([]), resolve=False))  # "${...}": follows another key
    rows = []
    for key, (verl_value, when) in VERL_DEFAULTS.items():
        omit = matters = 0
        for example in examples:
            values = {bare_key(o): o.split("=", 1)[1] for o in example.overrides if "=" in o}
            if key in values:
                continue
            omit += 1
            critic = values.get("algorithm.adv_estimator", "gae").strip("'\"") == "gae"
            actor_dynamic = _truthy(values.get("actor_rollout_ref.actor.use_dynamic_bsz"))
            critic_dynamic = _truthy(values.get("critic.use_dynamic_bsz", str(actor_dynamic)))
            matters += {
                "always": True,
                "critic": critic,
                "actor dynamic bsz": actor_dynamic,
                "critic dynamic bsz": critic and critic_dynamic,
            }[when]
        rows.append(
            {
                "key": key,
                "rlframe_default": ours.get(key, "(no such key)"),
                "verl_0_9_1_default": verl_value,
                "scripts_omitting": omit,
                "omitting_where_it_matters": matters,
                "matters_when": when,
            }
        )
    return rows


def summarize(results: list[ScriptResult], examples: list[Example]) -> dict:
    """Totals: scripts taken whole, key uses per status, the most refused keys, the ten defaults."""
    uses = [u for r in results for u in r.key_uses]
    counts = Counter(u.status for u in uses)
    total = len(uses)
    taken = counts["accepted"] + counts["warned"] + counts["refused_by_value"]
    refused = Counter((u.key, u.status) for u in uses if u.status in ("unknown", "added_unread", "refused_by_value"))
    return {
        "scripts": len(results),
        "taken_whole": sum(r.taken_whole for r in results),
        "verdicts": dict(Counter(r.verdict for r in results)),
        "key_uses": total,
        "key_use_status": dict(counts),
        "accepted_fraction": (counts["accepted"] + counts["warned"]) / total if total else 0.0,
        "taken_fraction": taken / total if total else 0.0,
        "unknown_fraction": counts["unknown"] / total if total else 0.0,
        "top_refused_keys": [{"key": k, "status": s, "uses": n} for (k, s), n in refused.most_common(30)],
        "first_messages": dict(Counter(_message_kind(r.first_message) for r in results if not r.taken_whole)),
        "defaults": default_reliance(examples),
    }


def _message_kind(message: str) -> str:
    """A first message with its values stripped, so that like failures count together."""
    unknown = UNKNOWN_KEY.search(message)
    if unknown:
        return "unknown config key"
    first_line = message.splitlines()[0] if message else ""
    return re.sub(r"'[^']*'|\d+", "…", first_line.split(";")[0])[:120]


def report(examples: list[Example]) -> tuple[list[ScriptResult], dict]:
    """Check every example; return the per-script results and the summary."""
    known = config_keys()
    with tempfile.TemporaryDirectory(prefix="verl_compat_") as tmp:
        folder = Path(tmp)
        model = make_stand_in_model(folder / "stand_in_model")
        reward_model = make_stand_in_reward_model(model, folder / "stand_in_reward_model")
        vision_model = make_stand_in_model(folder / "stand_in_vision_model", "builtin://tiny-vl")
        stand_ins = StandIns(folder, model, reward_model, vision_model)
        results = [check_script(example, known, stand_ins) for example in examples]
    return results, summarize(results, examples)


def verl_composes(examples: list[Example], config_dir: Path) -> dict[str, str]:
    """Per script: "ok" when verl's own Hydra config (`verl/trainer/config` of its wheel) composes its
    overrides, else the first line of Hydra's error. Config-level only: verl's Python checks do not run."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    verdicts = {}
    for example in examples:
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(config_dir.resolve()), version_base=None):
            try:
                compose(config_name="ppo_trainer", overrides=example.overrides)
                verdicts[example.name] = "ok"
            except Exception as err:  # Hydra's override and struct errors
                verdicts[example.name] = str(err).splitlines()[0]
    GlobalHydra.instance().clear()
    return verdicts


def print_verl_comparison(results: list[ScriptResult], verdicts: dict[str, str]) -> dict:
    """Scripts verl's config composes vs scripts rlframe takes whole; the ones only verl takes, listed."""
    ours = {r.name for r in results if r.taken_whole}
    theirs = {name for name, verdict in verdicts.items() if verdict == "ok"}
    counts = {
        "verl_composes": len(theirs),
        "both": len(ours & theirs),
        "rlframe_only": len(ours - theirs),
        "verl_only": len(theirs - ours),
        "neither": len(verdicts) - len(ours | theirs),
    }
    print(f"\nverl 0.9.1's own config composes {len(theirs)}/{len(verdicts)}: {counts}")
    for name in sorted(theirs - ours):
        print(f"  verl composes, rlframe refuses: {name}")
    for name in sorted(set(verdicts) - ours - theirs):
        print(f"  both refuse: {name}: verl: {verdicts[name][:110]}")
    return counts


def print_summary(summary: dict, results: list[ScriptResult]) -> None:
    """The table a person reads: scripts taken whole, key uses, refused keys, the ten defaults."""
    n, total = summary["scripts"], summary["key_uses"]
    print(f"scripts taken whole: {summary['taken_whole']}/{n}   {summary['verdicts']}")
    print(
        f"key uses: {total}; taken {summary['taken_fraction']:.1%}, accepted {summary['accepted_fraction']:.1%}, "
        f"unknown {summary['unknown_fraction']:.1%}"
    )
    for status, count in sorted(summary["key_use_status"].items(), key=lambda kv: -kv[1]):
        print(f"  {status:<17} {count:5d}  {count / total:6.1%}")
    print("\nwhy the other scripts are refused (first message of explain):")
    for kind, count in sorted(summary["first_messages"].items(), key=lambda kv: -kv[1]):
        print(f"  {count:3d}  {kind}")
    print("\ntop refused keys (uses):")
    for row in summary["top_refused_keys"]:
        print(f"  {row['uses']:4d}  {row['status']:<17} {row['key']}")
    print("\nthe ten defaults of issue 11 (scripts that omit the key, and of those where the value is used):")
    print(f"  {'key':<54} {'rlframe':>8} {'verl':>8} {'omit':>5} {'used':>5}")
    for row in summary["defaults"]:
        ours = str(row["rlframe_default"])
        ours = "=" + ours[2:-1].rsplit(".", 2)[-2] if ours.startswith("${") else ours  # "=actor": follows it
        print(
            f"  {row['key']:<54} {ours:>8} {row['verl_0_9_1_default']:>8} "
            f"{row['scripts_omitting']:5d} {row['omitting_where_it_matters']:5d}  ({row['matters_when']})"
        )
    print("\nscripts not taken whole:")
    for result in results:
        if not result.taken_whole:
            print(f"  {result.name}: {result.first_message.splitlines()[0][:150] if result.first_message else ''}")


def main(argv: list[str] | None = None) -> int:
    """Run the report over the corpus, print the summary, write the details as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="JSON file for the per-script and per-key details")
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--only", nargs="+", help="corpus file names (without .txt) to check")
    parser.add_argument(
        "--verl-config",
        type=Path,
        help="verl 0.9.1's verl/trainer/config folder (from its unpacked wheel): also compose each script with it",
    )
    args = parser.parse_args(argv)
    examples = read_corpus(args.corpus, args.only)
    results, summary = report(examples)
    print_summary(summary, results)
    verdicts = verl_composes(examples, args.verl_config) if args.verl_config else {}
    if verdicts:
        summary["verl_comparison"] = print_verl_comparison(results, verdicts)
    details = {
        "summary": summary,
        "scripts": [
            {**asdict(r), "taken_whole": r.taken_whole, "verl_composes": verdicts.get(r.name)} for r in results
        ],
    }
    Path(args.out).write_text(json.dumps(details, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
