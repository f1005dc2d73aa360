"""vLLM for a GPU machine that reaches no package registry and takes files in parts of at most 64 MiB (docs/gpu.md).

The lent GPU machines have Python 3.12, torch 2.11.0+cu130, transformers 5.17.0, triton 3.6.0, torchvision 0.26.0
and torchaudio 2.11.0. vLLM 0.26.0 is the newest release whose wheel pins that torch (`Requires-Dist: torch==2.11.0`;
0.27.0 onwards pin 2.13.0 or 2.14.0), and its other pins fit the image. Four steps, two machines:

    python scripts/vllm_offline.py prepare                 # here (a registry): resolve, download, manifest, parts
    python scripts/vllm_offline.py plan                    # here: the device calls that carry the parts
    python3 scripts/vllm_offline.py land                   # there, once per call: keep the carried part(s)
    python3 scripts/vllm_offline.py install                # there, last: join, verify, pip install, import vllm
    bash scripts/vllm_offline_check.sh STEPS               # there, last: `install` once, then gpu_check's STEPS

`prepare` resolves vLLM against the image's versions with a Python 3.12 pip (markers such as `python_version >
"3.11"` are evaluated by the interpreter that runs pip, not by `--python-version`), downloads every wheel of the set
except the image's own (the five pins above and torch's CUDA libraries), checks each against the hash the resolve
reported, writes manifest.json (each file's size, sha256 and offset) and cuts the files, one stream end to end, into
parts of at most 60 MiB. `install --dry-run` runs everything but pip here. Only the standard library is needed
there; `prepare` also uses `packaging` (pip's own copy will do).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM = "vllm==0.26.0"
# what the lent machines' image has (docs/gpu.md): the resolve is held to these and none of them is downloaded
IMAGE_PINS = ("torch==2.11.0", "triton==3.6.0", "transformers==5.17.0", "torchvision==0.26.0", "torchaudio==2.11.0")
IMAGE_CUDA_PREFIXES = ("nvidia-", "cuda-")  # torch's CUDA libraries (cuda-toolkit's nvidia-* wheels) are there too
PYTHON_VERSION = "3.12"
MAX_GLIBC = 35  # manylinux_2_N tags up to 2_35 (llguidance has only a 2_31 wheel); `install` checks the machine's
PART_BYTES = 60 * 2**20  # the device tool carries 64 MiB a call, the working tree (~3.5 MiB) included
OUT = os.path.join(ROOT, "build", "vllm_offline")  # ignored (.gitignore): wheels/, parts/, manifest.json
LANDING = os.environ.get("RLFRAME_VLLM_OFFLINE", "/tmp/rlframe-vllm-offline")  # there: parts/, wheels/, site/
CARRY_BYTES = 64 * 2**20
GPU_CHECK_STEPS = ("grpo vllm", "vllm rollout", "vllm async", "vllm lora", "vllm vl")
CHUNK = 2**20


# ---------------------------------------------------------------------------------------- files, parts, checksums
def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def file_entries(folder: str, names: list[str]) -> list[dict]:
    """One entry per file, in the given order: name, size, sha256 and offset in the stream of all of them."""
    entries, offset = [], 0
    for name in names:
        path = os.path.join(folder, name)
        size = os.path.getsize(path)
        entries.append({"name": name, "size": size, "sha256": sha256_of(path), "offset": offset})
        offset += size
    return entries


def split_into_parts(folder: str, files: list[dict], parts_dir: str, part_bytes: int) -> list[dict]:
    """Write the files, end to end, as parts of at most `part_bytes` (part-000, part-001, ...); their entries."""
    os.makedirs(parts_dir, exist_ok=True)
    parts, out, digest, written = [], None, None, 0

    def close() -> None:
        out.close()
        parts.append({"name": os.path.basename(out.name), "size": written, "sha256": digest.hexdigest()})

    for entry in files:
        with open(os.path.join(folder, entry["name"]), "rb") as src:
            while block := src.read(min(CHUNK, part_bytes)):
                while block:
                    if out is None or written == part_bytes:
                        if out is not None:
                            close()
                        out = open(os.path.join(parts_dir, f"part-{len(parts):03d}"), "wb")
                        digest, written = hashlib.sha256(), 0
                    piece, block = block[: part_bytes - written], block[part_bytes - written :]
                    out.write(piece)
                    digest.update(piece)
                    written += len(piece)
    if out is not None:
        close()
    return parts


def part_problems(manifest: dict, parts_dir: str) -> list[str]:
    """What is wrong with the parts in `parts_dir` (missing, wrong size, wrong sha256); empty when all are whole."""
    problems = []
    for part in manifest["parts"]:
        path = os.path.join(parts_dir, part["name"])
        if not os.path.isfile(path):
            problems.append(f"{part['name']}: missing")
        elif os.path.getsize(path) != part["size"]:
            problems.append(f"{part['name']}: {os.path.getsize(path)} bytes, the manifest says {part['size']}")
        elif sha256_of(path) != part["sha256"]:
            problems.append(f"{part['name']}: sha256 differs from the manifest's")
    return problems


def join_parts(manifest: dict, parts_dir: str, out_dir: str) -> list[str]:
    """Cut the parts' stream back into the manifest's files in `out_dir`; the files whose size or sha256 differ."""
    os.makedirs(out_dir, exist_ok=True)
    parts = iter(manifest["parts"])
    src, bad = None, []
    for entry in manifest["files"]:
        left, digest = entry["size"], hashlib.sha256()
        with open(os.path.join(out_dir, entry["name"]), "wb") as out:
            while left:
                block = src.read(min(CHUNK, left)) if src else b""
                if not block:  # this part is used up: the next one
                    if src:
                        src.close()
                    part = next(parts, None)
                    if part is None:
                        break
                    src = open(os.path.join(parts_dir, part["name"]), "rb")
                    continue
                out.write(block)
                digest.update(block)
                left -= len(block)
        if left or digest.hexdigest() != entry["sha256"]:
            bad.append(entry["name"])
    if src:
        src.close()
    return bad


def land_parts(manifest: dict, carried_dir: str, landing_dir: str) -> tuple[list[str], list[str]]:
    """Copy each whole carried part not landed yet into the landing folder; (landed now, still missing there).
    Parts carried by earlier calls stay in the carried folder too (ignored outputs are kept between calls)."""
    os.makedirs(landing_dir, exist_ok=True)
    landed = []
    for part in manifest["parts"]:
        src, dst = os.path.join(carried_dir, part["name"]), os.path.join(landing_dir, part["name"])
        if os.path.isfile(dst) and os.path.getsize(dst) == part["size"]:
            continue  # landed by an earlier call (install checks every sha256 again)
        if os.path.isfile(src) and not part_problems({"parts": [part]}, carried_dir):
            shutil.copyfile(src, os.path.join(landing_dir, part["name"]))
            landed.append(part["name"])
    missing = [p.split(":")[0] for p in part_problems(manifest, landing_dir)]
    return landed, missing


def device_calls(manifest: dict, tree_bytes: int, carry_bytes: int = CARRY_BYTES, extra_last: int = 0) -> list[list]:
    """The parts each device call carries (the working tree and the manifest travel with every call; the last call
    also carries `extra_last` bytes, the core wheelhouse), filled in order up to `carry_bytes` a call."""
    room = carry_bytes - tree_bytes - manifest_bytes(manifest)
    calls, current, used = [], [], 0
    for part in manifest["parts"]:
        if part["size"] > room:
            raise ValueError(f"{part['name']} ({part['size']} B) does not fit a call's {room} B; cut smaller parts")
        if used + part["size"] > room:
            calls.append(current)
            current, used = [], 0
        current.append(part["name"])
        used += part["size"]
    if current and used + extra_last <= room:
        calls.append(current + ["<wheelhouse>"])
    else:
        calls += [current] if current else []
        calls.append(["<wheelhouse>"])
    return calls


def manifest_bytes(manifest: dict) -> int:
    return len(json.dumps(manifest, indent=1).encode())


# ---------------------------------------------------------------------------------------- prepare (a registry)
def platform_flags() -> list[str]:
    """pip matches each manylinux tag exactly: name every glibc up to MAX_GLIBC (2_28 first: the wheels' own)."""
    glibcs = [28, *range(27, 4, -1), *range(29, MAX_GLIBC + 1)]
    flags = [f"manylinux_2_{n}_x86_64" for n in glibcs] + ["manylinux2014_x86_64", "manylinux2010_x86_64"]
    return [
        *(x for f in flags for x in ("--platform", f)),
        "--python-version",
        PYTHON_VERSION,
        "--implementation",
        "cp",
    ]


def resolve(python: str, work: str) -> dict:
    """pip's report of installing vLLM beside the image's pins (nothing installed; the wheels pass through pip)."""
    constraints = os.path.join(work, "image-constraints.txt")
    with open(constraints, "w") as f:
        f.write("\n".join(IMAGE_PINS) + "\n")
    report = os.path.join(work, "resolve.json")
    cmd = [python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-cache-dir", "--quiet"]
    cmd += ["--only-binary=:all:", *platform_flags(), "--target", os.path.join(work, "unused-target")]
    subprocess.run([*cmd, "-c", constraints, "--report", report, VLLM, *IMAGE_PINS], check=True)
    return json.load(open(report))


def _packaging():
    try:
        from packaging.requirements import Requirement
        from packaging.utils import canonicalize_name
    except ImportError:  # pip's own copy
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.utils import canonicalize_name
    return Requirement, canonicalize_name


def set_requirements(report: dict) -> list[tuple[str, object]]:
    """(requester, Requirement) for every requirement of the set that applies on the target: markers evaluated for
    the report's Python 3.12 environment, with the extras the set asks of each requester."""
    requirement, canon = _packaging()
    env = dict(report["environment"])
    reqs = [(canon(i["metadata"]["name"]), requirement(t)) for i in report["install"]
            for t in i["metadata"].get("requires_dist") or []]  # fmt: skip
    extras = {}
    for _, req in reqs:
        if not req.marker or req.marker.evaluate({**env, "extra": ""}):
            extras.setdefault(canon(req.name), set()).update(req.extras)
    return [
        (who, req)
        for who, req in reqs
        if not req.marker or any(req.marker.evaluate({**env, "extra": e}) for e in {"", *extras.get(who, ())})
    ]


def image_closure(report: dict) -> dict[str, str]:
    """{distribution: why} for what the image already has: its pins, and torch's CUDA libraries among their needs."""
    _, canon = _packaging()
    in_set = {canon(i["metadata"]["name"]) for i in report["install"]}
    needs = {}
    for who, req in set_requirements(report):
        needs.setdefault(who, []).append(canon(req.name))
    pins = [canon(p.split("==")[0]) for p in IMAGE_PINS]
    why = {name: "the image's own" for name in pins}
    todo = [(name, name) for name in pins]
    while todo:
        name, root = todo.pop()
        for dep in needs.get(name, []):
            if dep in in_set and dep not in why and dep.startswith(IMAGE_CUDA_PREFIXES):
                why[dep] = f"{root}'s CUDA library (the image has {root}'s)"
                todo.append((dep, root))
    return why


def read_freeze(path: str) -> dict[str, str]:
    """{distribution: version} from `pip freeze` or `pip list --format=freeze` output."""
    _, canon = _packaging()
    pairs = (line.split("==", 1) for line in open(path) if "==" in line and not line.startswith("#"))
    return {canon(name.strip()): version.strip() for name, version in pairs}


def met_by_image(report: dict, freeze: dict[str, str], skip: dict[str, str]) -> dict[str, str]:
    """{distribution: why} for the set's distributions the image has at a version every requirement on it accepts."""
    _, canon = _packaging()
    on = {}
    for _, req in set_requirements(report):
        on.setdefault(canon(req.name), []).append(req.specifier)
    why = {}
    for item in report["install"]:
        name = canon(item["metadata"]["name"])
        have = freeze.get(name)
        if name in skip or have is None:
            continue
        if all(spec.contains(have, prereleases=True) for spec in on.get(name, [])):
            why[name] = f"the image has {have}, which every requirement on it here accepts"
    return why


def download(python: str, report: dict, skip: dict[str, str], wheels_dir: str) -> list[dict]:
    """Download the report's wheels not in `skip`, check each against the report's sha256; their records."""
    _, canon = _packaging()
    wanted = [i for i in report["install"] if canon(i["metadata"]["name"]) not in skip]
    os.makedirs(wheels_dir, exist_ok=True)

    def whole(item: dict) -> bool:
        path = os.path.join(wheels_dir, item["download_info"]["url"].rsplit("/", 1)[1])
        return os.path.isfile(path) and sha256_of(path) == item["download_info"]["archive_info"]["hashes"]["sha256"]

    urls = [i["download_info"]["url"] for i in wanted if not whole(i)]
    cmd = [python, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--quiet", "-d", wheels_dir]
    if urls:
        subprocess.run([*cmd, "--only-binary=:all:", *platform_flags(), *urls], check=True)
    records = []
    for item in wanted:
        name = item["download_info"]["url"].rsplit("/", 1)[1]
        want = item["download_info"]["archive_info"]["hashes"]["sha256"]
        if sha256_of(os.path.join(wheels_dir, name)) != want:
            raise RuntimeError(f"{name}: its sha256 is not the one the resolve reported ({want})")
        records.append({"file": name, "dist": item["metadata"]["name"], "version": item["metadata"]["version"]})
    return records


def max_glibc(names: list[str]) -> str:
    """The newest glibc the set needs ("2.31"): a wheel tagged for several runs on its lowest; "" when none asks."""
    lowest = []
    for name in names:
        tags = [tuple(map(int, m)) for m in re.findall(r"manylinux_(\d+)_(\d+)", name)]
        tags += [(2, 17)] if "manylinux2014" in name else []
        tags += [(2, 12)] if "manylinux2010" in name else []
        if tags:
            lowest.append(min(tags))
    return "{}.{}".format(*max(lowest)) if lowest else ""


def prepare(args) -> int:
    """Resolve, download, write the manifest, cut the parts (everything under --out, an ignored folder)."""
    work = args.out
    os.makedirs(work, exist_ok=True)
    shutil.rmtree(os.path.join(work, "parts"), ignore_errors=True)
    reuse = args.reuse_resolve and os.path.isfile(os.path.join(work, "resolve.json"))
    report = json.load(open(os.path.join(work, "resolve.json"))) if reuse else resolve(args.python, work)
    skip = image_closure(report)
    _, canon = _packaging()
    skip.update({canon(n): "left out by --leave-out" for n in args.leave_out.split(",") if n})
    if args.image_freeze:
        skip.update(met_by_image(report, read_freeze(args.image_freeze), skip))
    wheels = os.path.join(work, "wheels")
    records = download(args.python, report, skip, wheels)
    kept = {r["file"] for r in records}
    for stale in set(os.listdir(wheels)) - kept:  # from an earlier prepare that kept more
        os.remove(os.path.join(wheels, stale))
    names = sorted(r["file"] for r in records)
    files = file_entries(wheels, names)
    by_file = {r["file"]: r for r in records}
    for entry in files:
        entry.update(dist=by_file[entry["name"]]["dist"], version=by_file[entry["name"]]["version"])
    parts = split_into_parts(wheels, files, os.path.join(work, "parts"), args.part_bytes)
    versions = {i["metadata"]["name"]: i["metadata"]["version"] for i in report["install"]}
    manifest = {
        "vllm": VLLM.split("==")[1],
        "python": PYTHON_VERSION,
        "max_glibc": max_glibc(names),
        "image_pins": list(IMAGE_PINS),
        "left_out": sorted(f"{n}=={versions.get(n, '?')}: {why}" for n, why in skip.items()),
        "total_bytes": sum(f["size"] for f in files),
        "part_bytes": args.part_bytes,
        "files": files,
        "parts": parts,
    }
    with open(os.path.join(work, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    print(summary(manifest))
    return 0


def summary(manifest: dict) -> str:
    mib = manifest["total_bytes"] / 2**20
    largest = sorted(manifest["files"], key=lambda f: -f["size"])[:8]
    lines = [
        f"vllm {manifest['vllm']} for Python {manifest['python']}: {len(manifest['files'])} wheels, {mib:.1f} MiB, "
        f"{len(manifest['parts'])} parts of <= {manifest['part_bytes'] / 2**20:.0f} MiB; newest glibc asked: "
        f"{manifest['max_glibc']}; left out: {len(manifest['left_out'])} (the image's own or asked)",
        "largest: " + ", ".join(f"{f['dist']} {f['size'] / 2**20:.1f}" for f in largest) + " (MiB)",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- plan (here)
def tree_bytes() -> int:
    """What the device tool sends with every call besides `carry`: tracked and untracked-not-ignored files."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True
    )
    paths = [p for p in out.stdout.decode().split("\0") if p]
    return sum(os.path.getsize(os.path.join(ROOT, p)) for p in paths if os.path.isfile(os.path.join(ROOT, p)))


def plan(args) -> int:
    """The device calls: which parts each carries and the command it runs."""
    manifest = json.load(open(os.path.join(args.out, "manifest.json")))
    wheelhouse = os.path.join(ROOT, "build", "gpu_wheels")
    extra = (
        sum(os.path.getsize(os.path.join(wheelhouse, f)) for f in os.listdir(wheelhouse))
        if os.path.isdir(wheelhouse)
        else 31 * 10**6
    )
    tree = tree_bytes()
    calls = device_calls(manifest, tree, extra_last=extra)
    rel = os.path.relpath(args.out, ROOT)
    print(summary(manifest))
    print(
        f"working tree {tree / 2**20:.1f} MiB + manifest travel with every call; core wheelhouse {extra / 2**20:.1f}"
        f" MiB with the last: {len(calls)} device calls"
    )
    for i, call in enumerate(calls):
        parts = [f"{rel}/parts/{p}" for p in call if p != "<wheelhouse>"]
        carry = [f"{rel}/manifest.json", *parts] + (["build/gpu_wheels"] if "<wheelhouse>" in call else [])
        cmd = "python3 scripts/vllm_offline.py land" if parts else ""
        if i == 0:  # the image's versions, for a later `prepare --image-freeze` (seconds)
            cmd = "python3 -m pip freeze > $OUT/image-freeze.txt; " + cmd
        if "<wheelhouse>" in call:
            cmd += (" && " if cmd else "") + f"bash scripts/vllm_offline_check.sh '{','.join(GPU_CHECK_STEPS[:2])}'"
        print(f"  call {i + 1}: carry={json.dumps(carry)} command={cmd!r}")
    rest = ",".join(GPU_CHECK_STEPS[2:])
    print(f"  call {len(calls) + 1}: carry=[] command=\"bash scripts/vllm_offline_check.sh '{rest}'\"")
    print("each call must follow the last within the machine's 30 s warm time: the landed parts live on that machine")
    return 0


# ---------------------------------------------------------------------------------------- land and install (there)
def land(args) -> int:
    manifest = json.load(open(args.manifest))
    landed, missing = land_parts(manifest, args.carried, os.path.join(args.landing, "parts"))
    print(
        f"[vllm_offline] landed {', '.join(landed) or 'nothing'}; {len(manifest['parts']) - len(missing)} of "
        f"{len(manifest['parts'])} parts in {args.landing}/parts"
        + (f"; missing {', '.join(missing)}" if missing else ": all there")
    )
    return 0


def glibc_problem(needed: str) -> str | None:
    """Why this machine's C library cannot load the set's wheels, or None."""
    name, _, version = (os.confstr("CS_GNU_LIBC_VERSION") or "").partition(" ")
    if not needed or name != "glibc":
        return None
    if tuple(map(int, version.split(".")[:2])) < tuple(map(int, needed.split("."))):
        return f"the set has wheels for glibc >= {needed}, this machine has {version}"
    return None


def image_has(names_versions: list[tuple[str, str]]) -> set[str]:
    """The distributions of the list installed here (the image) at exactly that version."""
    from importlib import metadata

    have = set()
    for dist, version in names_versions:
        try:
            if metadata.version(dist) == version:
                have.add(dist)
        except metadata.PackageNotFoundError:
            pass
    return have


def install(args) -> int:
    """Check every part, join them into the wheels, check every wheel, then pip install the ones the image lacks at
    that version into --site with --no-index --no-deps, and import vllm beside the image's torch."""
    manifest = json.load(open(args.manifest))
    args.site = args.site or os.path.join(args.landing, "site")
    parts_dir, wheels = os.path.join(args.landing, "parts"), os.path.join(args.landing, "wheels")
    problems = part_problems(manifest, parts_dir)
    if problems:
        print("[vllm_offline] parts not whole: " + "; ".join(problems), file=sys.stderr)
        return 1
    bad = join_parts(manifest, parts_dir, wheels)
    if bad:
        print(f"[vllm_offline] joined files whose size or sha256 differ: {', '.join(bad)}", file=sys.stderr)
        return 1
    print(
        f"[vllm_offline] {len(manifest['parts'])} parts -> {len(manifest['files'])} wheels, every sha256 as in "
        f"the manifest ({manifest['total_bytes'] / 2**20:.1f} MiB)"
    )
    problem = glibc_problem(manifest["max_glibc"])
    if sys.version_info[:2] != tuple(map(int, manifest["python"].split("."))):
        problem = f"the set is for Python {manifest['python']}, this is {sys.version.split()[0]}"
    if problem and not args.dry_run:
        print(f"[vllm_offline] {problem}", file=sys.stderr)
        return 1
    if problem:
        print(f"[vllm_offline] would stop here on this machine: {problem}")
    present = image_has([(f["dist"], f["version"]) for f in manifest["files"]])
    todo = [f for f in manifest["files"] if f["dist"] not in present]
    cmd = [args.python, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile", "--quiet",
           "--disable-pip-version-check", "--upgrade", "--target", args.site]  # fmt: skip
    have = ", ".join(sorted(present))
    print(f"[vllm_offline] skipping {len(present)} this Python (the image there) has at that version: {have}")
    print(f"[vllm_offline] {'would run' if args.dry_run else 'running'}: {' '.join(cmd)} <{len(todo)} wheels>")
    for f in todo:
        print(f"    {f['dist']}=={f['version']}  {f['size'] / 2**20:8.1f} MiB  {f['name']}")
    if args.dry_run:
        return 0
    subprocess.run([*cmd, *(os.path.join(wheels, f["name"]) for f in todo)], check=True)
    pythonpath = site_pythonpath(args.python, args.site)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (pythonpath, os.environ.get("PYTHONPATH")) if p))
    check = subprocess.run([args.python, "-m", "pip", "check"], env=env, capture_output=True, text=True)
    names = {f["dist"].lower().replace("_", "-") for f in manifest["files"]} | {"vllm"}
    unmet = [line for line in check.stdout.splitlines() if line.split(" ")[0].lower().replace("_", "-") in names]
    print("[vllm_offline] pip check, the set's lines: " + ("; ".join(unmet) if unmet else "every requirement met"))
    probe = ("import torch, vllm; print(f'[vllm_offline] vllm {vllm.__version__} imports beside torch "
             "{torch.__version__} (CUDA {torch.version.cuda}), from {vllm.__file__}')")  # fmt: skip
    if subprocess.run([args.python, "-c", probe], env=env).returncode:
        return 1
    with open(os.path.join(args.site, "pythonpath.txt"), "w") as f:  # scripts/vllm_offline_check.sh reads it
        f.write(pythonpath)
    return 0


def site_pythonpath(python: str, site_dir: str) -> str:
    """PYTHONPATH for the installed folder: the folder, then what its .pth files add (PYTHONPATH entries are not
    site directories, so Python skips their .pth files: nvidia-cutlass-dsl's puts its `cutlass` package on the path).
    """
    code = (
        "import os, site, sys\n"
        "before = list(sys.path)\n"
        "site.addsitedir(sys.argv[1])\n"
        "print(os.pathsep.join([sys.argv[1]] + [p for p in sys.path if p not in before and p != sys.argv[1]]))\n"
    )
    out = subprocess.run([python, "-c", code, site_dir], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("prepare", help="here: resolve, download, manifest, parts")
    p.add_argument("--python", default=shutil.which("python3.12") or "python3.12", help="a Python 3.12 with pip")
    p.add_argument("--out", default=OUT)
    p.add_argument("--part-bytes", type=int, default=PART_BYTES)
    p.add_argument("--leave-out", default="", help="comma-separated distributions not to carry (docs/gpu.md: lean)")
    p.add_argument("--image-freeze", default=None, help="the image's `pip freeze`: leave out what it already meets")
    p.add_argument("--reuse-resolve", action="store_true", help="use --out's resolve.json from an earlier prepare")
    p = sub.add_parser("plan", help="here: the device calls that carry the parts")
    p.add_argument("--out", default=OUT)
    for verb in ("land", "install"):
        p = sub.add_parser(verb, help="on the GPU machine")
        p.add_argument("--manifest", default=os.path.join(OUT, "manifest.json"))
        p.add_argument("--landing", default=LANDING, help="the folder the parts are kept in between calls")
        if verb == "land":
            p.add_argument("--carried", default=os.path.join(OUT, "parts"), help="where this call's parts came")
        else:
            p.add_argument("--site", default=None, help="pip's --target (default: LANDING/site)")
            p.add_argument("--python", default=sys.executable, help="the image's Python (its torch)")
            p.add_argument("--dry-run", action="store_true", help="join and verify, print what pip would install")
    args = parser.parse_args(argv)
    return {"prepare": prepare, "plan": plan, "land": land, "install": install}[args.verb](args)


if __name__ == "__main__":
    sys.exit(main())
