"""The built-in tools against a hostile policy: floods, fork bombs, escapes, hangs and huge numbers.

Each case ends with the tool answering a text (never raising), and no process of the program left on the machine.
The bubblewrap cases use `sandbox: bwrap` unconditionally: `scripts/test.sh` installs bubblewrap, and a machine
without it fails them (PythonTool refuses `sandbox: bwrap` where bwrap cannot run) instead of skipping.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import threading
import time
import uuid

import pytest

from rlframe.workers.rollout import tools as tools_module
from rlframe.workers.rollout.sandbox.cgroups import RunCgroups
from rlframe.workers.rollout.tools import CalculatorTool, PythonTool, ToolRunner, load_tool_config

# the limit tests' clocks of 1-5 s: on a machine busy with another test file, a program may not start in time
pytestmark = pytest.mark.serial


def run_code(code: str, **config) -> str:
    """The text PythonTool answers for `code`. The limit is roomy unless a test sets it: a program that ends answers
    when it ends, and a sandboxed interpreter's start alone can take seconds on a busy machine."""
    tool = PythonTool({"timeout_s": 30, **config}, None)
    response, _, _ = asyncio.run(tool.execute("i", {"code": code}))
    return response.text


def marked(code: str, marker: str) -> str:
    """A program that re-execs itself with `marker` in its command line, so its processes can be found in /proc."""
    return (
        f"import os, sys\nos.execv(sys.executable, [sys.executable, '-I', '-c', {('# ' + marker + chr(10) + code)!r}])"
    )


def processes_with(marker: str, wait_s: float = 5.0) -> list[int]:
    """Live processes whose command line holds `marker`, after giving SIGKILLed ones up to `wait_s` to vanish
    (a zombie's command line is empty, so it does not count)."""
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    if marker.encode() in handle.read():
                        found.append(int(entry))
            except OSError:
                continue
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def new_marker() -> str:
    return f"rlframe_hostile_{uuid.uuid4().hex}"


# ----------------------------------------------------------------------------------------- python
def test_a_print_flood_keeps_the_parent_memory_flat_and_says_the_output_was_cut():
    flood = "import sys\nfor _ in range(200):\n    sys.stdout.buffer.write(b'x' * 2**20)\nprint('end')"
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # resets this process's peak resident size (VmHWM)
    text = run_code(flood, timeout_s=30, max_output_chars=1000)
    peak_growth_mb = (_status_kb("VmHWM") - _status_kb("VmRSS")) / 1024
    assert peak_growth_mb < 20, f"the parent's peak grew by {peak_growth_mb:.0f} MB while reading 200 MB"
    assert text.startswith("x" * 1000) and "(output truncated to 1000 characters)" in text
    assert "exit status" not in text and "longer than" not in text  # drained to the end, not killed


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as handle:
        line = next(line for line in handle if line.startswith(field + ":"))
    return int(line.split()[1])


@pytest.mark.parametrize("sandbox", ["bwrap", "none"])
def test_a_fork_bomb_is_capped_and_nothing_of_it_survives(sandbox):
    marker = new_marker()
    bomb = (
        "import os, time\ncount = 0\nwhile count < 2000:\n    try:\n        if os.fork() == 0:\n"
        "            time.sleep(60)\n            os._exit(0)\n        count += 1\n    except OSError:\n        break\n"
        "print('forked', count, flush=True)\ntime.sleep(60)"
    )
    # 5 s: time for the interpreter to start and fork on a busy machine, then the limit kills what sleeps
    text = run_code(marked(bomb, marker), timeout_s=5, max_processes=16, sandbox=sandbox)
    # the kernel ignores RLIMIT_NPROC for root, which `sandbox: none` as root stays: the pids cgroup is the cap there
    probe = RunCgroups.create(16, 2**30)
    probe.remove()
    if "pids" not in probe.bounds and os.getuid() == 0 and sandbox == "none":
        pytest.fail("no pids cgroup can be made here: as root with sandbox: none, a fork bomb is then unbounded")
    forked = int(text.split("forked ")[1].split()[0])
    assert forked < 16 and "longer than 5 s" in text
    assert processes_with(marker) == []


@pytest.mark.parametrize(
    "sandbox, detach",
    [("bwrap", "start_new_session=True"), ("none", "start_new_session=False"), ("none", "start_new_session=True")],
)
def test_a_detached_grandchild_does_not_outlive_the_call(sandbox, detach):
    marker = new_marker()
    child = f"import time; time.sleep(120)  # {marker}"
    code = (
        f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', {child!r}], {detach}, "
        "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\nprint('spawned')"
    )
    text = run_code(code, sandbox=sandbox)
    assert text.strip() == "spawned"  # answered when the program ended, not at the timeout
    assert processes_with(marker) == []


def test_a_program_that_sleeps_past_the_timeout_is_killed_with_its_children():
    marker = new_marker()
    child = f"import time; time.sleep(120)  # {marker}"
    code = f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {child!r}])\ntime.sleep(120)"
    text = run_code(marked(code, marker), timeout_s=1)
    assert "longer than 1 s and was killed" in text
    assert processes_with(marker) == []


def test_the_outer_tool_timeout_kills_the_program():
    marker = new_marker()
    runner = ToolRunner({"python": PythonTool({"timeout_s": 60}, None)}, timeout_s=1, max_response_chars=1000)
    code = marked("import time\ntime.sleep(120)", marker)
    result = asyncio.run(runner.call("python", {"code": code}, {}))
    assert result.error == "timeout" and "timed out after 1 s" in result.text
    assert processes_with(marker) == []


def test_files_outside_the_folder_are_out_of_reach_under_bubblewrap(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("do not read")
    code = (
        f"for path in ['/etc/hostname', {str(secret)!r}]:\n    try:\n        print(open(path).read())\n"
        f"    except OSError as err:\n        print('refused', type(err).__name__)\n"
        f"try:\n    open({str(tmp_path / 'written.txt')!r}, 'w').write('x')\nexcept OSError as err:\n"
        f"    print('refused', type(err).__name__)\nopen('mine.txt', 'w').write('ok')\nprint(open('mine.txt').read())"
    )
    text = run_code(code, sandbox="bwrap")
    assert text.split() == ["refused", "FileNotFoundError"] * 3 + ["ok"]
    assert not (tmp_path / "written.txt").exists()


def test_sockets_reach_nothing_under_bubblewrap():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        code = (
            f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "    print('connected')\nexcept OSError as err:\n    print('refused', type(err).__name__)"
        )
        text = run_code(code, sandbox="bwrap")
    assert text.startswith("refused"), text


def test_writes_fill_only_a_small_tmpfs_under_bubblewrap():
    code = (
        "import os\ntry:\n    for i in range(100):\n        with open(f'f{i}', 'wb') as handle:\n"
        "            handle.write(b'x' * 2**20)\nexcept OSError as err:\n    print('stopped at', i, err.strerror)"
    )
    text = run_code(code, sandbox="bwrap", disk_mb=8)
    assert "No space left on device" in text and int(text.split("stopped at ")[1].split()[0]) <= 8


@pytest.mark.parametrize(
    "code, answers",
    [
        ("def f(n):\n    return f(n + 1)\nf(0)", ["RecursionError"]),
        ("x = 1 << 2**33", ["MemoryError"]),  # 1 GiB at once, past memory_mb
        ("x = 2 ** (2 ** 36)", ["MemoryError", "longer than 10 s"]),  # grows by squaring: memory or time runs out
        ("x = bytearray(2 ** 33)", ["MemoryError"]),
    ],
    ids=["recursion", "huge-shift", "huge-power", "huge-alloc"],
)
def test_deep_recursion_and_huge_numbers_in_python_end_in_an_error_text(code, answers):
    text = run_code(code, timeout_s=10)
    assert any(answer in text for answer in answers), text


def test_an_unknown_sandbox_mode_is_refused_naming_the_key(tmp_path):
    config = tmp_path / "tools.yaml"
    config.write_text(
        "tools:\n  - class_name: rlframe.workers.rollout.tools.PythonTool\n"
        "    config: {type: native, sandbox: docker}\n"
    )
    with pytest.raises(
        ValueError, match=r"tool_config_path=.*tools.yaml: tools\[0\]: PythonTool config: sandbox='docker'"
    ):
        load_tool_config(str(config))
    with pytest.raises(ValueError, match=r"sandbox='docker' is not one of \['auto', 'bwrap', 'none'\]"):
        PythonTool({"sandbox": "docker"}, None)
    with pytest.raises(ValueError, match=r"max_processes=0 must be a positive int"):
        PythonTool({"max_processes": 0}, None)


def test_a_hostile_program_in_a_trajectory_is_answered_and_the_trajectory_goes_on(tiny_model_path):
    from helpers.multi_turn import PROMPT_LEN, ScriptedEngine, make_prompts, rollout_cfg
    from transformers import AutoTokenizer

    from rlframe.workers.rollout.multi_turn import build_multi_turn

    marker = new_marker()
    child = f"import time; time.sleep(120)  # {marker}"
    code = f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {child!r}])\nprint('x' * 10**7)"
    code += "\ntime.sleep(120)"
    tool_call = json.dumps({"name": "python", "arguments": {"code": code}})
    script = {"Q": [f"<tool_call>{tool_call}</tool_call>", "done"]}
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    overrides = ["actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent", "data.max_response_length=1024"]
    cfg = rollout_cfg(*overrides, "actor_rollout_ref.rollout.multi_turn.tool_timeout_s=1")
    rollout = build_multi_turn(ScriptedEngine(cfg, tokenizer, tiny_model_path, script), tokenizer)
    rollout.runner.tools["python"] = PythonTool({"timeout_s": 60}, None)
    out = rollout.generate_sequences(make_prompts(tokenizer, ["Q"]))
    text = tokenizer.decode(out.batch["responses"][0][out.batch["attention_mask"][0, PROMPT_LEN:].bool()])
    assert "timed out after 1 s" in text and text.endswith("done<|im_end|>")
    assert out.meta_info["metrics"]["multi_turn/tool_errors_per_trajectory"] == [1.0]
    assert processes_with(marker) == []


# ----------------------------------------------------------------------------------------- calculator
def test_the_calculator_refuses_huge_intermediate_results_and_deep_nesting():
    runner = ToolRunner({"calculator": CalculatorTool({}, None)}, timeout_s=10, max_response_chars=200)
    cases = {
        "(((2**64)**64)**64)**64": "more than the limit of 4096",
        "((((((2**64)**64)**64)**64)**64)**64)": "more than the limit of 4096",
        "9**9**9": "more than the limit of 4096",
        "2**(2**4000)": "more than the limit of 4096",
        "(10**1000) * (10**1000)": "more than the limit of 4096",
        "-" * 1900 + "1": "nested too deeply",
        "1+" * 3000 + "1": "too long",
    }
    for expression, error in cases.items():
        result = asyncio.run(runner.call("calculator", {"expression": expression}, {}))
        assert result.error == "raised" and error in result.text, (expression[:40], result.text)
    exact = asyncio.run(runner.call("calculator", {"expression": "2**4000 - 2**3999 * 2 + 7"}, {}))
    assert exact.text == "7"
    small = CalculatorTool({"max_bits": 64}, None)
    assert (
        "limit of 64"
        in asyncio.run(ToolRunner({"calculator": small}, 10, 200).call("calculator", {"expression": "2**64"}, {})).text
    )


def test_the_calculator_runs_off_the_event_loop_so_the_tool_timeout_answers(monkeypatch):
    release = threading.Event()

    def stuck(expression, max_bits):  # stands for an evaluation that holds its thread
        release.wait(30)
        return 0

    monkeypatch.setattr(tools_module, "evaluate_arithmetic", stuck)
    runner = ToolRunner({"calculator": CalculatorTool({}, None)}, timeout_s=0.2, max_response_chars=200)

    async def call_then_release():
        try:
            return await runner.call("calculator", {"expression": "1"}, {})
        finally:
            release.set()  # lets asyncio.run's executor shutdown finish

    assert asyncio.run(call_then_release()).error == "timeout"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
