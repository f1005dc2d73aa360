"""scripts/test.sh's two passes on several processes (RLFRAME_TEST_WORKERS > 0): RLFRAME_TEST_PASS=parallel collects
every test but those marked `serial`, RLFRAME_TEST_PASS=serial those alone, and unset every test (tests/conftest.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # three pytest collections in subprocesses
# one file marked serial as a whole, and one with a single serial test beside others
FILES = ["workers/rollout/test_tool_sandbox.py", "workers/test_sft_equivalence.py"]


def collected(test_pass: str | None) -> set[str]:
    env = {k: v for k, v in os.environ.items() if k != "RLFRAME_TEST_PASS"}
    if test_pass is not None:
        env["RLFRAME_TEST_PASS"] = test_pass
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *FILES],
        cwd=TESTS,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode in (0, 5), out.stdout[-3000:] + out.stderr[-3000:]
    return {line.split("::")[1].split("[")[0] for line in out.stdout.splitlines() if "::" in line}


def test_each_pass_collects_its_share_and_together_every_test():
    every, parallel, serial = collected(None), collected("parallel"), collected("serial")
    assert "test_sft_loss_and_gradient_equal_plain_nll_on_smollm2_shapes" in serial
    assert "test_a_fork_bomb_is_capped_and_nothing_of_it_survives" in serial  # the whole file is serial
    assert "test_sft_loss_and_gradient_equal_plain_nll_on_smollm2_shapes" not in parallel
    assert parallel and not parallel & serial and parallel | serial == every


def test_an_unknown_pass_is_refused_naming_the_variable_and_the_values():
    with pytest.raises(AssertionError, match="RLFRAME_TEST_PASS='both': accepted are parallel, serial"):
        collected("both")
