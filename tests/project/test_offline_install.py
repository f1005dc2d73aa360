"""scripts/vllm_offline.py without a network: a few small fake wheels cut into parts, landed call by call, joined
back and checked, as the GPU machine does with vLLM's wheel set (docs/gpu.md, "vLLM offline")."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load_script():
    spec = importlib.util.spec_from_file_location("vllm_offline", os.path.join(ROOT, "scripts", "vllm_offline.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


vllm_offline = _load_script()
PART = 1000  # bytes: small parts so that files straddle them


@pytest.fixture
def wheel_set(tmp_path):
    """Four fake wheels (one empty, one larger than a part, one exactly a part), their manifest and parts."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    sizes = {"a-1.0-py3-none-any.whl": 2500, "b-2.0-py3-none-any.whl": 0, "c-0.1-py3-none-any.whl": 1000,
             "d-3.0-cp312-cp312-manylinux_2_31_x86_64.whl": 7}  # fmt: skip
    for i, (name, size) in enumerate(sizes.items()):
        (wheels / name).write_bytes(bytes((i * 37 + k) % 251 for k in range(size)))
    files = vllm_offline.file_entries(str(wheels), sorted(sizes))
    parts = vllm_offline.split_into_parts(str(wheels), files, str(tmp_path / "parts"), PART)
    manifest = {"files": files, "parts": parts, "total_bytes": sum(sizes.values())}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    return tmp_path, manifest


def test_parts_are_at_most_the_part_size_and_add_up_to_the_files(wheel_set):
    tmp_path, manifest = wheel_set
    sizes = [p["size"] for p in manifest["parts"]]
    assert sizes == [1000, 1000, 1000, 507]
    assert [p["name"] for p in manifest["parts"]] == ["part-000", "part-001", "part-002", "part-003"]
    offsets = [f["offset"] for f in manifest["files"]]
    assert offsets == [0, 2500, 2500, 3500]
    assert vllm_offline.part_problems(manifest, str(tmp_path / "parts")) == []


def test_join_gives_back_every_file_byte_for_byte(wheel_set, tmp_path):
    parts_dir = wheel_set[0] / "parts"
    out = tmp_path / "joined"
    assert vllm_offline.join_parts(wheel_set[1], str(parts_dir), str(out)) == []
    for entry in wheel_set[1]["files"]:
        assert (out / entry["name"]).read_bytes() == (wheel_set[0] / "wheels" / entry["name"]).read_bytes()


def test_a_corrupt_or_short_part_is_named_and_its_files_fail_the_join(wheel_set, tmp_path):
    root, manifest = wheel_set
    part = root / "parts" / "part-001"
    data = bytearray(part.read_bytes())
    data[10] ^= 0xFF
    part.write_bytes(bytes(data))
    assert vllm_offline.part_problems(manifest, str(root / "parts")) == ["part-001: sha256 differs from the manifest's"]
    assert vllm_offline.join_parts(manifest, str(root / "parts"), str(tmp_path / "joined")) == [
        "a-1.0-py3-none-any.whl"
    ]
    (root / "parts" / "part-003").write_bytes(b"short")
    (root / "parts" / "part-002").unlink()
    problems = vllm_offline.part_problems(manifest, str(root / "parts"))
    assert problems[1:] == ["part-002: missing", "part-003: 5 bytes, the manifest says 507"]


def test_parts_landed_call_by_call_join_only_when_all_are_there(wheel_set, tmp_path):
    root, manifest = wheel_set
    landing = tmp_path / "landing"
    for i, part in enumerate(manifest["parts"]):  # each call carries one part, in a folder of its own
        carried = tmp_path / f"call{i}"
        carried.mkdir()
        (carried / part["name"]).write_bytes((root / "parts" / part["name"]).read_bytes())
        landed, missing = vllm_offline.land_parts(manifest, str(carried), str(landing))
        assert landed == [part["name"]]
        assert missing == [p["name"] for p in manifest["parts"][i + 1 :]]
    assert vllm_offline.join_parts(manifest, str(landing), str(tmp_path / "joined")) == []


def test_a_carried_part_that_is_not_whole_is_not_landed(wheel_set, tmp_path):
    root, manifest = wheel_set
    carried = tmp_path / "carried"
    carried.mkdir()
    (carried / "part-000").write_bytes((root / "parts" / "part-000").read_bytes()[:-1])
    landed, missing = vllm_offline.land_parts(manifest, str(carried), str(tmp_path / "landing"))
    assert landed == [] and len(missing) == 4


def test_install_dry_run_joins_verifies_and_prints_the_pip_command(wheel_set, tmp_path, capsys):
    root, manifest = wheel_set
    manifest.update(vllm="0", python=f"{sys.version_info[0]}.{sys.version_info[1]}", max_glibc="")
    (root / "manifest.json").write_text(json.dumps(manifest))
    for entry in manifest["files"]:
        entry.update(dist=entry["name"].split("-")[0], version=entry["name"].split("-")[1])
    (root / "manifest.json").write_text(json.dumps(manifest))
    landing = tmp_path / "landing"
    vllm_offline.land_parts(manifest, str(root / "parts"), str(landing / "parts"))
    code = vllm_offline.main(
        ["install", "--dry-run", "--manifest", str(root / "manifest.json"), "--landing", str(landing)]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "4 parts -> 4 wheels, every sha256 as in the manifest" in out
    assert "would run: " in out and "--no-index --no-deps" in out and "--target" in out
    assert "d==3.0" in out


def test_device_calls_fill_each_call_up_to_the_carry_limit():
    manifest = {"parts": [{"name": f"part-{i:03d}", "size": 60} for i in range(5)], "files": []}
    room_for = 64 + vllm_offline.manifest_bytes(manifest)  # a tree of 0 bytes: one 60-byte part a call
    calls = vllm_offline.device_calls(manifest, tree_bytes=0, carry_bytes=room_for, extra_last=31)
    assert calls == [["part-000"], ["part-001"], ["part-002"], ["part-003"], ["part-004"], ["<wheelhouse>"]]
    calls = vllm_offline.device_calls(manifest, tree_bytes=0, carry_bytes=room_for + 60, extra_last=4)
    assert calls == [["part-000", "part-001"], ["part-002", "part-003"], ["part-004", "<wheelhouse>"]]
    with pytest.raises(ValueError, match="cut smaller parts"):
        vllm_offline.device_calls(manifest, tree_bytes=10, carry_bytes=room_for)


def test_max_glibc_is_the_newest_lowest_tag_of_any_wheel():
    names = [
        "a-1-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
        "b-1-cp39-abi3-manylinux_2_31_x86_64.whl",
        "c-1-cp38-abi3-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl",
        "d-1-py3-none-any.whl",
    ]
    assert vllm_offline.max_glibc(names) == "2.31"
    assert vllm_offline.max_glibc(names[2:]) == "2.27"
    assert vllm_offline.max_glibc(names[3:]) == ""


def _item(name: str, version: str, *requires: str) -> dict:
    return {"metadata": {"name": name, "version": version, "requires_dist": list(requires)}}


FAKE_REPORT = {
    "environment": {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
                    "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
                    "os_name": "posix", "platform_python_implementation": "CPython", "platform_release": "",
                    "platform_version": "", "implementation_version": "3.12.3"},
    "install": [
        _item("vllm", "0.26.0", "torch==2.11.0", "numba==0.65.0", "six>=1.16; python_version > '3.11'",
              "nvidia-cutlass-dsl[cu13]==4.6.0", "av; extra == 'audio'"),
        _item("torch", "2.11.0", "cuda-toolkit[cudart]==13.0.2; platform_system == 'Linux'", "sympy>=1.13"),
        _item("cuda-toolkit", "13.0.2", "nvidia-cuda-runtime==13.0.96.*; extra == 'cudart'",
              "nvidia-npp==13.0.1.2.*; extra == 'npp'"),
        _item("nvidia-cuda-runtime", "13.0.96"), _item("nvidia-npp", "13.0.1.2"), _item("sympy", "1.14.0"),
        _item("numba", "0.65.0", "numpy<2.5,>=1.22"), _item("numpy", "2.3.5"), _item("six", "1.17.0"),
        _item("nvidia-cutlass-dsl", "4.6.0", "nvidia-cutlass-dsl-libs-cu13==4.6.0; extra == 'cu13'"),
        _item("nvidia-cutlass-dsl-libs-cu13", "4.6.0"), _item("triton", "3.6.0"), _item("transformers", "5.17.0"),
        _item("torchvision", "0.26.0"), _item("torchaudio", "2.11.0"),
    ],
}  # fmt: skip


def test_the_image_keeps_its_pins_and_torchs_cuda_libraries_with_the_extras_asked():
    left_out = vllm_offline.image_closure(FAKE_REPORT)
    assert set(left_out) == {
        "torch", "triton", "transformers", "torchvision", "torchaudio", "cuda-toolkit", "nvidia-cuda-runtime",
    }  # fmt: skip
    # sympy is torch's but not CUDA's; nvidia-npp is behind an extra nobody asks; cutlass is vLLM's own
    applies = {(who, str(req)) for who, req in vllm_offline.set_requirements(FAKE_REPORT)}
    assert ("vllm", 'six>=1.16; python_version > "3.11"') in applies  # the marker read for 3.12, not pip's own
    assert ("nvidia-cutlass-dsl", 'nvidia-cutlass-dsl-libs-cu13==4.6.0; extra == "cu13"') in applies
    assert not any("av" == req.split(";")[0] for _, req in applies)


def test_image_freeze_leaves_out_only_what_every_requirement_accepts(tmp_path):
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("numpy==2.5.2\nnumba==0.65.0\nsix==1.17.0\nsympy==1.14.0\n# comment\n-e git+x#egg=y\n")
    skip = vllm_offline.image_closure(FAKE_REPORT)
    met = vllm_offline.met_by_image(FAKE_REPORT, vllm_offline.read_freeze(str(freeze)), skip)
    assert set(met) == {"numba", "six", "sympy"}  # numpy is carried: numba asks <2.5, the image has 2.5.2
