"""Extract the Hydra overrides of verl's FSDP PPO/GRPO example scripts into a corpus of text files.

    python scripts/extract_verl_examples.py VERL_GIT_DIR [--out tests/assets/verl_examples]

VERL_GIT_DIR is a clone of verl (bare or not); the scripts are read from its HEAD commit. Each script
is run by bash with every external command missing, so nothing is executed: bash's
`command_not_found_handle` records the arguments that follow `verl.trainer.main_ppo`, after the shell
has expanded variables, defaults (`${X:-d}`), arithmetic, arrays and `${X//a/b}` exactly as on a
cluster. Variables the script reads from the environment without a default get a marker value, and
the overrides holding a marker get a placeholder (see PLACEHOLDERS). The corpus README says why.

Only bash builtins run, in a temporary copy of verl's examples/ (the working directory); at the
commit the corpus comes from, no script redirects output to an absolute path.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ENTRY = "verl.trainer.main_ppo"
# verl's split-placement example wraps the same trainer and config keys in its own entry file.
ENTRY_FILES = ("verl/trainer/main_ppo.py", "main_ppo_split.py")
RECORD_END = "\x1e"  # separates one recorded invocation from the next in the capture file
MARKER = re.compile(r"@ENV:(\w+)@")
# Shell variables bash sets itself, or that must not be faked (PATH stays empty on purpose).
SHELL_VARIABLES = {
    "PWD",
    "OLDPWD",
    "RANDOM",
    "LINENO",
    "SECONDS",
    "HOSTNAME",
    "UID",
    "EUID",
    "PPID",
    "IFS",
    "PATH",
    "SHLVL",
    "FUNCNAME",
    "BASH_SOURCE",
    "BASH_VERSION",
    "HOSTTYPE",
    "OSTYPE",
    "MACHTYPE",
    "PIPESTATUS",
    "BASHPID",
    "SHELL",
    "GROUPS",
    "REPLY",
    "OPTARG",
    "OPTIND",
}
# What an override gets when its value comes from the environment with no default (README.md of the
# corpus lists these): model folders and data files become rlframe's built-ins, the cluster size
# verl's defaults; any other key gets ENV_<NAME> in place of the variable, or an empty value (what
# bash expands an unset variable to) when the variable is the whole value.
MODEL_KEYS = re.compile(r"(^|\.)(model\.path|tokenizer_path|input_tokenizer|tokenizer)$")
DATA_KEYS = re.compile(r"^data\.(train_files|val_files)$")
PLACEHOLDERS = {
    "model": "builtin://tiny",
    "data": "builtin://countdown_add",
    "trainer.nnodes": "1",
    "trainer.n_gpus_per_node": "8",
}
# The scripts run in a copy of verl's tree (bash's PWD); other paths into it are written from this name.
CHECKOUT = "VERL_CHECKOUT"
# Scripts that choose their backend with a plain assignment; the corpus takes the FSDP option the
# script documents next to it (its comment lists "fsdp, fsdp2, megatron").
VARIANTS = {"examples/gspo_trainer/run_qwen30b_gspo.sh": ("backend", "megatron", "fsdp")}

# Sourced by bash before the script (BASH_ENV). A missing `tee` closes its end of a pipe at once; with
# SIGPIPE ignored, the recording side of `python3 ... 2>&1 | tee log` is not killed by set -x's trace.
PRELUDE = r"""
trap '' PIPE
command_not_found_handle() {
    local i=0 args=("$@")
    for ((i = 0; i < ${#args[@]}; i++)); do
        if [[ "${args[i]}" == "%(entry)s" || %(files)s ]]; then
            printf '%%s\0' "${args[i]}" "${args[@]:i+1}" >> "$VERL_EXTRACT_CAPTURE"
            printf '%(end)s' >> "$VERL_EXTRACT_CAPTURE"
            return 0
        fi
    done
    return 0
}
kill() { :; }  # a builtin: cleanup lines such as `kill $(cat ray.pid)` must not reach real processes
# errexit/nounset off: a missing `source`d file or tool must not end the script before main_ppo.
set() {
    local arg out=()
    for arg in "$@"; do
        if [[ $arg == -[!-]* && $arg != -o ]]; then arg=${arg//[eu]/}; [[ $arg == - ]] && continue; fi
        out+=("$arg")
    done
    builtin set "${out[@]}"
}
"""


@dataclass
class Extraction:
    """The overrides of one script, its Hydra options, and which placeholders were used."""

    source: str
    entry: str
    overrides: list[str]
    hydra_options: list[str]
    placeholders: dict[str, str] = field(default_factory=dict)  # override key -> "VAR -> placeholder"
    variant: str | None = None
    shell_errors: list[str] = field(default_factory=list)


def git(repo: str, *args: str) -> str:
    """Output of one git command on the verl clone."""
    return subprocess.run(["git", "-C", repo, *args], check=True, capture_output=True, text=True).stdout


def candidate_scripts(repo: str) -> list[str]:
    """Shell scripts under examples/ at HEAD that name verl's PPO entry (main_ppo, or main_ppo_split.py)."""
    names = git(repo, "ls-tree", "-r", "HEAD", "--name-only", "examples").split("\n")
    return [n for n in names if n.endswith(".sh") and "main_ppo" in git(repo, "show", f"HEAD:{n}")]


def environment_variables(text: str) -> set[str]:
    """Variables the script reads but never assigns and never gives a default: they come from outside."""
    text = re.sub(r"^\s*#.*$", "", text, flags=re.M)  # a commented-out `export X=8` assigns nothing
    used = set(re.findall(r"\$\{?([A-Za-z_]\w*)", text))
    assigned = set(
        re.findall(r"(?:^|[\s;(])(?:export\s+|local\s+|declare\s+(?:-\w+\s+)?)?([A-Za-z_]\w*)\+?=", text, re.M)
    )
    assigned |= set(re.findall(r"\bfor\s+([A-Za-z_]\w*)\s+in\b", text))
    assigned |= set(re.findall(r"\bread\s+(?:-\w+\s+)*([A-Za-z_]\w*)", text))
    defaulted = set(re.findall(r"\$\{([A-Za-z_]\w*):?[-=]", text))
    return used - assigned - defaulted - SHELL_VARIABLES


def run_script(tree: Path, rel: str, text: str) -> tuple[list[list[str]], list[str]]:
    """Run the script with no external commands: the argument lists from main_ppo on, and bash's errors."""
    script = tree / rel
    script.write_text(text)
    capture = tree / ".capture"
    capture.write_bytes(b"")
    prelude = tree / ".prelude.sh"
    files = " || ".join(f'"${{args[i]}}" == *{name}' for name in ENTRY_FILES)
    prelude.write_text(PRELUDE % {"entry": ENTRY, "files": files, "end": RECORD_END})
    env = {name: f"@ENV:{name}@" for name in environment_variables(text)}
    env.update(PATH=str(tree / ".no-commands"), BASH_ENV=str(prelude), VERL_EXTRACT_CAPTURE=str(capture))
    if "HOME" not in env:
        env["HOME"] = "@ENV:HOME@"  # tilde expansion reads HOME
    done = subprocess.run(
        ["/bin/bash", str(script)],
        cwd=tree,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=60,
        text=True,
    )
    records = capture.read_bytes().decode().split(RECORD_END)
    # bash's own errors ("division by 0", a bad substitution) may change values; ulimit and the
    # cluster's own `source`d files are about the machine, not the command line
    errors = [
        line.split(f"{script}: ", 1)[1]
        for line in done.stderr.splitlines()
        if f"{script}: line " in line and not re.search(r"ulimit:|No such file or directory", line)
    ]
    return [[a for a in record.split("\0") if a] for record in records if record], errors


def split_options(args: list[str]) -> tuple[list[str], list[str]]:
    """Hydra's own options (`--config-name=x`, `--config-path x`) apart from the key=value overrides."""
    options, overrides = [], []
    pending = False
    for arg in args:
        if pending:
            options[-1] += f"={arg}"
            pending = False
        elif arg.startswith("-"):
            options.append(arg)
            pending = "=" not in arg
        else:
            overrides.append(arg)
    return options, overrides


def is_fsdp(overrides: list[str], options: list[str]) -> bool:
    """No megatron config (--config-name) and no megatron strategy among the overrides."""
    config_names = [o.split("=", 1)[-1] for o in options if o.startswith("--config-name")]
    strategies = [o.split("=", 1)[1] for o in overrides if re.search(r"(^|\.)strategy=", o.lstrip("+"))]
    return not any("megatron" in v for v in config_names + strategies)


def placeholder_for(override: str) -> tuple[str, str | None]:
    """The override with its environment markers replaced, and a note of what was done (None: nothing)."""
    found = sorted(set(MARKER.findall(override)))
    if not found or "=" not in override:
        return override, None
    key, value = override.split("=", 1)
    bare = key.lstrip("+~")
    category = "model" if MODEL_KEYS.search(bare) else "data" if DATA_KEYS.match(bare) else bare
    if category in PLACEHOLDERS:
        new = PLACEHOLDERS[category]
    elif MARKER.fullmatch(value):
        new = ""
    else:
        new = MARKER.sub(lambda m: CHECKOUT if m.group(1) == "PWD" else f"ENV_{m.group(1)}", value)
    return f"{key}={new}", f"${', $'.join(found)} -> {new!r}"


def extract(repo: str, tree: Path, rel: str) -> Extraction | None:
    """The overrides of one script, or None when it does not run main_ppo on FSDP."""
    text = git(repo, "show", f"HEAD:{rel}")
    variant = None
    if rel in VARIANTS:
        name, old, new = VARIANTS[rel]
        text, count = re.subn(rf"^{name}={old}\b", f"{name}={new}", text, flags=re.M)
        if count != 1:
            raise RuntimeError(f"{rel}: expected one '{name}={old}' line to switch to {new}")
        variant = f"{name}={new} (the script's own FSDP option; it ships with {name}={old})"
    records, errors = run_script(tree, rel, text)
    if len(records) != 1:
        raise RuntimeError(f"{rel}: expected one {ENTRY} invocation, recorded {len(records)}")
    entry, args = records[0][0], [a for a in records[0][1:] if a != "$@" and a.strip()]
    options, overrides = split_options(args)
    options = [o.replace(str(tree), CHECKOUT) for o in options]
    if not is_fsdp(overrides, options):
        return None
    out = Extraction(rel, entry, [], options, variant=variant, shell_errors=errors)
    for override in overrides:
        if "\n" in override:
            raise RuntimeError(f"{rel}: an override spans lines: {override!r}")
        new, how = placeholder_for(override.replace(str(tree), "@ENV:PWD@"))
        out.overrides.append(new)
        if how:
            out.placeholders[new.split("=", 1)[0]] = how
    return out


def corpus_name(rel: str) -> str:
    """examples/ppo_trainer/run_x.sh -> ppo_trainer__run_x.txt"""
    return rel.removeprefix("examples/").removesuffix(".sh").replace("/", "__") + ".txt"


def render(item: Extraction, commit: str, version: str) -> str:
    """One corpus file: a header of comments, then one override per line."""
    lines = [
        f"# source: {item.source}",
        f"# verl commit: {commit} (verl/version/version: {version})",
        f"# entry: {item.entry}",
    ]
    if item.hydra_options:
        lines.append(f"# hydra options: {' '.join(item.hydra_options)}")
    if item.variant:
        lines.append(f"# variant: {item.variant}")
    lines += [f"# placeholder: {key}: {how}" for key, how in item.placeholders.items()]
    lines += [f"# shell error (errexit/nounset off): {error}" for error in item.shell_errors]
    return "\n".join(lines + item.overrides) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write one corpus file per FSDP main_ppo script of the verl clone; print the selection."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("verl_dir", help="a verl git clone (bare or with a work tree)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "tests/assets/verl_examples"))
    args = parser.parse_args(argv)
    commit = git(args.verl_dir, "rev-parse", "HEAD").strip()
    version = git(args.verl_dir, "show", "HEAD:verl/version/version").strip()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.txt"):
        old.unlink()
    taken, skipped = [], []
    with tempfile.TemporaryDirectory(prefix="verl_examples_") as tmp:
        tree = Path(tmp) / "verl"
        archive = subprocess.run(
            ["git", "-C", args.verl_dir, "archive", "HEAD", "examples"], check=True, capture_output=True
        ).stdout
        tree.mkdir()
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        (tree / ".no-commands").mkdir()
        for rel in candidate_scripts(args.verl_dir):
            item = extract(args.verl_dir, tree, rel)
            if item is None:
                skipped.append(rel)
                continue
            (out / corpus_name(rel)).write_text(render(item, commit, version))
            taken.append(rel)
        shutil.rmtree(tree, ignore_errors=True)
    print(
        f"verl {version} at {commit}: {len(taken) + len(skipped)} scripts run main_ppo; "
        f"{len(taken)} FSDP written to {out}, {len(skipped)} megatron skipped"
    )
    for rel in skipped:
        print(f"  skipped (megatron): {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
