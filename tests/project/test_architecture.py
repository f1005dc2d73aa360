"""Layout rules (docs/architecture.md): a package imports only earlier ones; sections live in config modules."""

import ast
import importlib
import pkgutil
from pathlib import Path

import rlframe
from rlframe.config.schema import Section

ROOT = Path(__file__).resolve().parents[2]
# Lowest first. A package may import itself and any package listed before it, never one after it.
LAYERS = [
    "protocol",
    "seqpack",
    "utils",
    "config",
    "distributed",
    "models",
    "algorithms",
    "batch_plan",
    "data",
    "single_controller",
    "reward",
    "workers",
    "trainer",
    "explain",
    "viz",
    "cli",
]


def rlframe_imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported rlframe package) for every import in a file, including those inside functions."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        else:
            continue
        found += [
            (node.lineno, name.split(".")[1]) for name in names if name.startswith("rlframe.") and name.count(".") >= 1
        ]
    return found


def package_of(path: Path) -> str:
    """`rlframe/workers/actor.py` → "workers"; `rlframe/seqpack.py` → "seqpack"."""
    parts = path.relative_to(ROOT / "rlframe").with_suffix("").parts
    return parts[0]


def test_every_rlframe_package_has_a_layer():
    packages = {package_of(p) for p in (ROOT / "rlframe").rglob("*.py")} - {"__init__"}
    assert packages <= set(LAYERS), f"add {sorted(packages - set(LAYERS))} to LAYERS and to docs/architecture.md"


def test_imports_point_only_to_lower_layers():
    wrong = []
    for path in sorted((ROOT / "rlframe").rglob("*.py")):
        importer = package_of(path)
        if importer == "__init__":
            continue
        for line, imported in rlframe_imports(path):
            if LAYERS.index(imported) > LAYERS.index(importer):
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({importer}) imports rlframe.{imported}")
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_workers_never_import_the_trainer():
    # the sharpest case of the rule above, named so that a failure explains itself
    offenders = [
        f"{p.relative_to(ROOT)}:{line}"
        for p in (ROOT / "rlframe" / "workers").rglob("*.py")
        for line, imported in rlframe_imports(p)
        if imported == "trainer"
    ]
    assert not offenders


def test_no_reference_to_documents_outside_the_repository():
    # Design notes that live outside the repository must be brought into docs/, not cited.
    cited = [
        f"{p.relative_to(ROOT)}"
        for folder in ("rlframe", "tests", "docs", "bench", "scripts")
        for p in (ROOT / folder).rglob("*")
        if p.suffix in (".py", ".md", ".sh") and "DESIGN" + " §" in p.read_text()
    ]
    assert not cited


# An argument list longer than this wants an object (a spec, a plan, the role's config section).
MAX_WORKER_PARAMETERS = 8


def test_no_function_in_the_workers_takes_more_than_eight_parameters():
    too_long = []
    for path in sorted((ROOT / "rlframe" / "workers").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            args = node.args
            names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
            names += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
            count = len(names) - (names[:1] in (["self"], ["cls"]))
            if count > MAX_WORKER_PARAMETERS:
                too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({count})")
    assert not too_long, too_long


def subclasses(cls: type) -> set[type]:
    """Every class deriving from `cls`, however indirectly."""
    return {sub for direct in cls.__subclasses__() for sub in (direct, *subclasses(direct))}


def test_every_config_section_is_declared_in_a_config_module():
    # one place to look for a key: the `config.py` of the package that reads it, or a file of its `config/` package
    for module in pkgutil.walk_packages(rlframe.__path__, "rlframe."):
        importlib.import_module(module.name)
    misplaced = sorted(
        f"{cls.__module__}.{cls.__qualname__}"
        for cls in subclasses(Section)
        if cls.__module__.startswith("rlframe.") and "config" not in cls.__module__.split(".")[1:]
    )
    assert not misplaced, "declare these sections in their package's config module:\n" + "\n".join(misplaced)
