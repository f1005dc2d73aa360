"""The step's phase budget: this tree's synchronous GRPO step against a reference commit's, phase by phase, in one run.

    python bench/phase_budget.py                          # this tree vs REFERENCE, SmolLM2, responses <= 32
    python bench/phase_budget.py --response-length 128    # the longer job
    python bench/phase_budget.py --rounds 3 --steps 8     # more alternations, longer runs (less noise)
    python bench/phase_budget.py --ref 1a2b3c4 --candidate 5d6e7f8   # two commits (a bisection step)

Each tree (a commit checked out as a detached git worktree under the system's temporary folder, or this working tree
with its uncommitted changes) runs `bench/e2e_grpo.py`'s rlframe job (`job_for`, `run_rlframe`: 2 CPU workers, HF
rollout, no TRL) in a subprocess whose `PYTHONPATH` puts that tree's `rlframe` first, with this tree's harness and
this venv. Rounds alternate the order (ref first, then candidate first, ...) so that a drift in the machine's load
falls on both. Per phase the median over rounds of each run's median step is printed, with the candidate's ratio to
the reference; a phase that grew by more than `--budget` (10%) is named at the end. No timed assertion anywhere:
the machines are shared, and the verdict is for a person to read (docs/benchmarks.md, "Phase budget").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from _common import print_table

# the last commit before the step got slower (issue 44's e4f6e5f), against which every stop that touches the step's
# path is compared; move it forward only with a measurement that shows the new one at least as fast in every phase
REFERENCE = "e4f6e5f"
BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
CHILD = """
import json, sys
sys.path.insert(0, {bench!r})
import e2e_grpo
import rlframe
assert rlframe.__file__.startswith({tree!r}), rlframe.__file__  # the tree under test, not the venv's install
job = e2e_grpo.dataclasses.replace(e2e_grpo.job_for({model!r}), max_response_length={length})
figures = e2e_grpo.run_rlframe(job, {steps}, {skip})
with open({out!r}, "w") as handle:
    json.dump(figures, handle)
"""


def worktree(commit: str, into: str) -> str:
    """A detached worktree of `commit` under `into` (removed by the caller's cleanup)."""
    path = os.path.join(into, commit.replace("/", "_"))
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "--force", path, commit], check=True,
                   capture_output=True)  # fmt: skip
    return path


def run_tree(tree: str, args: argparse.Namespace, out: str) -> dict:
    """One rlframe run of the job with `tree`'s rlframe; its figures (step, phases) from e2e_grpo.run_rlframe."""
    code = CHILD.format(
        bench=BENCH, tree=tree, model=args.model, length=args.response_length, steps=args.steps, skip=args.skip, out=out
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (tree, os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the run of {tree} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    with open(out) as handle:
        return json.load(handle)


def compare(runs: dict[str, list[dict]], budget: float) -> list[str]:
    """Print the phase table (median over rounds); the phases of the candidate that grew past `budget`."""
    ref, cand = runs["ref"], runs["candidate"]
    names = list(dict.fromkeys([*ref[0]["phases"], *cand[0]["phases"]]))
    rows, grew = [], []
    for name in ["step", *names]:
        pick = (lambda r: r["step_s"]) if name == "step" else (lambda r, n=name: r["phases"].get(n))
        a = [v for v in map(pick, ref) if v is not None]
        b = [v for v in map(pick, cand) if v is not None]
        if not a or not b:
            rows.append([name, _fmt(a), _fmt(b), "", "only in one"])
            continue
        ratio = statistics.median(b) / statistics.median(a) if statistics.median(a) > 0 else float("inf")
        slower = ratio > 1 + budget and statistics.median(b) - statistics.median(a) > 0.005  # below 5 ms: noise
        rows.append([name, _fmt(a), _fmt(b), f"{ratio:.2f}x", "GREW" if slower else ""])
        if slower:
            grew.append(f"{name} {statistics.median(a):.3f} -> {statistics.median(b):.3f} s ({ratio:.2f}x)")
    print_table(["phase (median s per step)", "reference", "candidate", "candidate / ref", ""], rows)
    return grew


def _fmt(values: list[float]) -> str:
    return f"{statistics.median(values):.3f}" if values else "—"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", default=REFERENCE, help=f"the reference commit (default {REFERENCE})")
    parser.add_argument("--candidate", default=None, help="a commit to compare (default: this working tree)")
    parser.add_argument("--model", default="builtin://smollm2-135m-instruct")
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--skip", type=int, default=1, help="warm-up steps left out of each run's medians")
    parser.add_argument("--rounds", type=int, default=2, help="runs per tree, alternating the order")
    parser.add_argument("--budget", type=float, default=0.10, help="growth that names a phase (0.10: 10%%)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rlframe_phase_budget_") as scratch:
        trees = {"ref": worktree(args.ref, scratch)}
        trees["candidate"] = worktree(args.candidate, scratch) if args.candidate else ROOT
        runs: dict[str, list[dict]] = {"ref": [], "candidate": []}
        loads = [f"{os.getloadavg()[0]:.1f}"]
        try:
            for round_index in range(args.rounds):
                order = ["ref", "candidate"] if round_index % 2 == 0 else ["candidate", "ref"]
                for which in order:
                    out = os.path.join(scratch, f"{which}_{round_index}.json")
                    runs[which].append(run_tree(trees[which], args, out))
                    loads.append(f"{os.getloadavg()[0]:.1f}")
                    print(f"round {round_index + 1}/{args.rounds} {which}: step {runs[which][-1]['step_s']:.3f} s",
                          flush=True)  # fmt: skip
        finally:
            for tree in trees.values():
                if tree != ROOT:
                    subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree], capture_output=True)
    candidate = args.candidate or "this working tree"
    print(
        f"\nGRPO step, {args.model}, responses <= {args.response_length}, {args.steps} steps per run (medians skip "
        f"{args.skip}), {args.rounds} rounds; reference {args.ref}, candidate {candidate}; "
        f"1-min load before and after each run: {' / '.join(loads)}\n"
    )
    grew = compare(runs, args.budget)
    print("\nphases that grew by more than {:.0%}: {}".format(args.budget, "; ".join(grew) if grew else "none"))


if __name__ == "__main__":
    main()
