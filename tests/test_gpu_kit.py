"""bench/gpu_kit.py, which carries what a lent GPU machine lacks in parts that each fit one device call: the parts
join back into the very kit, every call carries the manifest and one part, and a part that is missing, broken or
from another pack stops the install by name. No device is needed: the parts travel between folders here."""

from __future__ import annotations

import shutil
import sys
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import gpu_kit  # noqa: E402


@pytest.fixture
def kit_sources(tmp_path):
    """Stand-in wheels (zips of random bytes, deflated like pip's) and a tokenizer folder."""
    wheels, tokenizer = tmp_path / "wheels", tmp_path / "tokenizer"
    wheels.mkdir()
    tokenizer.mkdir()
    rng = __import__("random").Random(0)
    for name, size in (("a-1.0-py3-none-any.whl", 70_000), ("b-2.0-cp312-cp312-manylinux_2_28_x86_64.whl", 50_000)):
        with zipfile.ZipFile(wheels / name, "w", zipfile.ZIP_DEFLATED) as wheel:
            wheel.writestr("pkg/lib.so", rng.randbytes(size))
            wheel.writestr("pkg/__init__.py", "x = 1\n" * 500)
    (tokenizer / "tokenizer.json").write_text('{"model": {}}')
    (tokenizer / "tokenizer_config.json").write_text("{}")
    return sorted(wheels.glob("*.whl")), tokenizer


def carry(kit: Path, part: str, device_repo: Path) -> Path:
    """What one device call brings: the manifest and one part, in the repository copy's .gpukit."""
    carried = device_repo / ".gpukit"
    shutil.rmtree(carried, ignore_errors=True)  # carried paths replace what the last call left
    carried.mkdir(parents=True)
    for name in ("manifest.json", part):
        shutil.copyfile(kit / name, carried / name)
    return carried


def test_parts_carried_one_per_call_join_back_into_the_kit(kit_sources, tmp_path):
    wheels, tokenizer = kit_sources
    kit = tmp_path / "repo" / ".gpukit"
    manifest = gpu_kit.pack(wheels, tokenizer, kit, part_bytes=30_000)
    assert len(manifest["parts"]) >= 4 and all(p["bytes"] <= 30_000 for p in manifest["parts"])
    assert sorted(path.name for path in kit.iterdir()) == sorted(
        ["manifest.json", *(p["name"] for p in manifest["parts"])]
    )

    stash = tmp_path / "stash"
    names = [p["name"] for p in manifest["parts"]]
    for index, name in enumerate(names):
        missing = gpu_kit.receive(carry(kit, name, tmp_path / "device"), stash)
        assert missing == names[index + 1 :]
    gpu_kit.assemble(stash, stash / "kit")
    for wheel in wheels:  # the same members, stored rather than deflated
        with zipfile.ZipFile(wheel) as original, zipfile.ZipFile(stash / "kit" / "wheels" / wheel.name) as carried:
            assert [m.filename for m in carried.infolist()] == original.namelist()
            assert {m.compress_type for m in carried.infolist()} == {zipfile.ZIP_STORED}
            assert all(carried.read(name) == original.read(name) for name in original.namelist())
    assert (stash / "kit" / "tokenizer" / "tokenizer.json").read_bytes() == (tokenizer / "tokenizer.json").read_bytes()
    assert not (stash / "kit.tar.xz").exists()  # the joined archive is not kept beside what it unpacked


def test_a_missing_or_broken_part_stops_the_install_by_name(kit_sources, tmp_path):
    wheels, tokenizer = kit_sources
    kit = tmp_path / ".gpukit"
    manifest = gpu_kit.pack(wheels, tokenizer, kit, part_bytes=30_000)
    stash = tmp_path / "stash"
    shutil.copytree(kit, stash)

    (stash / "part-01").unlink()
    with pytest.raises(gpu_kit.KitError, match=r"part-01 is missing.*make the calls that carry them again"):
        gpu_kit.assemble(stash, stash / "kit")

    shutil.copyfile(kit / "part-01", stash / "part-01")
    broken = bytearray((kit / "part-02").read_bytes())
    broken[100] ^= 1  # one flipped bit in transit
    (stash / "part-02").write_bytes(bytes(broken))
    with pytest.raises(gpu_kit.KitError, match=r"part-02 differs from the manifest"):
        gpu_kit.assemble(stash, stash / "kit")
    assert not (stash / "kit").exists()  # nothing unpacked from a kit that did not check out
    assert len(manifest["parts"]) > 2


def test_parts_of_another_pack_do_not_join(kit_sources, tmp_path):
    """Each part matches its own manifest entry, and still the joined archive must be the one packed: a part list
    edited by hand (here: one part left out of the manifest) is caught by the archive's digest."""
    wheels, tokenizer = kit_sources
    kit = tmp_path / ".gpukit"
    manifest = gpu_kit.pack(wheels, tokenizer, kit, part_bytes=30_000)
    stash = tmp_path / "stash"
    shutil.copytree(kit, stash)
    manifest["parts"] = manifest["parts"][:-1]
    (stash / "manifest.json").write_text(__import__("json").dumps(manifest))
    with pytest.raises(gpu_kit.KitError, match="joined parts differ from the manifest's archive"):
        gpu_kit.assemble(stash, stash / "kit")


def test_the_plan_carries_the_manifest_and_one_part_per_call(kit_sources, tmp_path):
    wheels, tokenizer = kit_sources
    kit = gpu_kit.REPO / ".gpukit-test-plan"
    try:
        manifest = gpu_kit.pack(wheels, tokenizer, kit, part_bytes=40_000)
        calls = gpu_kit.device_calls(manifest, kit)
    finally:
        shutil.rmtree(kit, ignore_errors=True)
    part_calls = calls[: len(manifest["parts"])]
    assert [call["carry"][1].rsplit("/", 1)[1] for call in part_calls] == [p["name"] for p in manifest["parts"]]
    assert all(call["carry"][0] == ".gpukit-test-plan/manifest.json" for call in part_calls)
    assert all(call["command"].startswith("python3 bench/gpu_kit.py receive") for call in part_calls)
    assert "install" in part_calls[-1]["command"] and "install" not in part_calls[0]["command"]
    last = part_calls[-1]["command"]
    assert "install && {" in last and "run tests" in last and "--exports-only" in last and last.endswith("wait; }")
    assert last.index("install") < last.index("--exports-only") < last.index("run tests")
    bench_calls = calls[len(part_calls) :]
    assert len(bench_calls) == 2 and all("--reuse-exports" in call["command"] for call in bench_calls)
    assert [call["command"].split("--exports ")[1] for call in bench_calls] == [
        "ours-fp16,builder-fp16-cuda",
        "ours-int4-fp16,builder-int4-cuda",
    ]


def test_pack_refuses_a_tokenizer_folder_without_its_files(kit_sources, tmp_path):
    wheels, _ = kit_sources
    with pytest.raises(gpu_kit.KitError, match=r"empty: no tokenizer.json, tokenizer_config.json"):
        gpu_kit.pack(wheels, tmp_path / "empty", tmp_path / ".gpukit", part_bytes=30_000)
    with pytest.raises(gpu_kit.KitError, match="no room for a part"):
        gpu_kit.pack(wheels, tmp_path, tmp_path / ".gpukit", part_bytes=-5)
    assert not (tmp_path / ".gpukit").exists()


def test_the_device_runs_every_file_with_gpu_tests():
    tests = Path(__file__).resolve().parent
    marked = {
        path.relative_to(tests.parent).as_posix()
        for path in tests.rglob("test_*.py")
        if "mark.gpu" in path.read_text() and path.name != Path(__file__).name
    }
    assert marked == set(gpu_kit.GPU_TEST_FILES)


def test_the_kits_python_turns_hub_kernels_off(tmp_path):
    """transformers >= 5.25 kernelizes every model it loads by default and refuses to load one where the image's own
    ``kernels`` package is of another version (every CUDA test failed so on an H200): the kit's Python says no."""
    import os
    import subprocess

    python = tmp_path / "python"
    python.write_text(gpu_kit.WRAPPER.format(path=tmp_path, libraries="", python=sys.executable))
    python.chmod(0o755)
    env = {key: value for key, value in os.environ.items() if key != "USE_HUB_KERNELS"}
    probe = "import os; print(os.environ.get('USE_HUB_KERNELS'))"
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.strip() == "NO"
