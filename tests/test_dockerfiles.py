"""Each Dockerfile's Python satisfies pyproject's ``requires-python`` (read statically: no Docker engine here).

Every build stage that starts from an external image gets its Python from the image itself (the
official ``python:X.Y`` images) or from what its ``RUN`` lines install with the distribution's package
manager: ``python3.X`` explicitly, or ``python3``, whose version is the distribution's. A base image
this test does not know fails with a message saying where to add it.
"""

from __future__ import annotations

import pathlib
import re
import tomllib

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCKERFILES = sorted(ROOT.glob("Dockerfile*"))

# The default python3 of each distribution release, found in a base image tag.
DISTRIBUTION_PYTHON = {
    "ubuntu20.04": "3.8", "ubuntu22.04": "3.10", "ubuntu24.04": "3.12",
    "debian11": "3.9", "bullseye": "3.9", "debian12": "3.11", "bookworm": "3.11", "debian13": "3.13", "trixie": "3.13",
}
# Images that carry their own Python (regardless of their distribution): pattern -> version group.
PYTHON_IMAGES = re.compile(r"^(?:docker\.io/)?(?:library/)?python:(?P<version>3\.\d+)")
DISTRIBUTION_IN_TAG = re.compile(
    r"^(?:docker\.io/)?(?:library/)?(?:"
    r"ubuntu:(?P<ubuntu>\d\d\.\d\d)"
    r"|debian:(?P<debian>[a-z]+|\d+)(?:-slim)?"
    r"|nvidia/cuda:[\w.-]*-(?P<cuda>ubuntu\d\d\.\d\d)"
    r")$"
)


def requires_python() -> SpecifierSet:
    return SpecifierSet(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"])


def stages(text: str) -> list[tuple[str, str]]:
    """(resolved base image, the stage's instructions) per stage, with ARG defaults substituted."""
    text = re.sub(r"\\\n", " ", text)
    args: dict[str, str] = {}
    result: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        if word.upper() == "ARG" and "=" in rest:
            name, _, default = rest.partition("=")
            args.setdefault(name.strip(), default.strip().strip('"'))
        elif word.upper() == "FROM":
            image = next(t for t in rest.split() if not t.startswith("--"))
            image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), image)
            result.append((image, []))
        elif result:
            result[-1][1].append(line)
    return [(image, "\n".join(lines)) for image, lines in result]


def stage_python(image: str, instructions: str, stage_names: set[str]) -> str | None:
    """The Python version a stage runs, or ``None`` when it builds on another stage or has none."""
    if image in stage_names:
        return None  # another stage of this file: checked on its own
    if match := PYTHON_IMAGES.match(image):
        return match["version"]
    match = DISTRIBUTION_IN_TAG.match(image)
    if match is None:
        pytest.fail(f"unknown base image {image!r}: add it with its Python version to DISTRIBUTION_PYTHON or "
                    "PYTHON_IMAGES in tests/test_dockerfiles.py")
    release = f"ubuntu{match['ubuntu']}" if match["ubuntu"] else match["cuda"] or match["debian"]
    if release.isdigit():
        release = f"debian{release}"
    installs = " ".join(re.findall(r"(?:apt-get|apt) install[^&;]*", instructions))
    if explicit := re.search(r"\bpython(3\.\d+)\b", installs):
        return explicit.group(1)
    if re.search(r"\bpython3\b", installs):
        if release not in DISTRIBUTION_PYTHON:
            pytest.fail(f"{image!r}: the default python3 of {release!r} is unknown; add it to DISTRIBUTION_PYTHON "
                        "in tests/test_dockerfiles.py")
        return DISTRIBUTION_PYTHON[release]
    if re.search(r"\b(python3?|pip3?)\b", instructions):
        pytest.fail(f"{image!r} has no Python, and this stage installs none but runs python or pip")
    return None


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_stage_runs_a_python_the_package_supports(dockerfile):
    specifier = requires_python()
    found = stages(dockerfile.read_text())
    names = {line.split()[-1] for line in dockerfile.read_text().splitlines()
             if line.upper().startswith("FROM ") and " AS " in line.upper()}
    checked = []
    for image, instructions in found:
        version = stage_python(image, instructions, names)
        if version is not None:
            assert Version(version) in specifier, (
                f"{dockerfile.name}: the stage FROM {image} runs Python {version}, but pyproject.toml requires "
                f"{specifier}; use a base whose distribution ships a newer python3 or install python3.X explicitly"
            )
            checked.append(image)
    assert checked, f"{dockerfile.name}: no stage with a Python found"


@pytest.mark.parametrize(("image", "run", "expected"), [
    ("python:3.12.12-slim-bookworm", "", "3.12"),
    ("nvidia/cuda:12.4.1-cudnn-runtime-ubuntu22.04", "apt-get install -y python3 python3-venv", "3.10"),
    ("nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04", "apt-get install -y python3 python3-venv", "3.12"),
    ("ubuntu:22.04", "apt-get install -y --no-install-recommends python3.11 python3.11-venv", "3.11"),
    ("debian:bookworm-slim", "apt-get install -y python3", "3.11"),
])
def test_the_python_of_a_stage_is_read_from_its_base_and_install_line(image, run, expected):
    assert stage_python(image, f"RUN apt-get update && {run}" if run else "", set()) == expected


def test_an_unknown_base_image_asks_to_be_added():
    with pytest.raises(pytest.fail.Exception, match="add it with its Python version"):
        stage_python("alpine:3.20", "RUN apk add python3", set())


# The first patch release of each minor whose tarfile filters refuse links out of the destination
# (CVE-2025-4517 and its siblings); `sluice pull` unpacks archives and refuses them itself as well.
TARFILE_FIXED = {"3.9": "3.9.23", "3.10": "3.10.18", "3.11": "3.11.13", "3.12": "3.12.11", "3.13": "3.13.4"}
PINNED_PYTHON = re.compile(r"^(?:docker\.io/)?(?:library/)?python:(?P<version>3\.\d+\.\d+)")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_pinned_python_images_have_the_tarfile_fixes(dockerfile):
    pinned = [(image, PINNED_PYTHON.match(image)) for image, _ in stages(dockerfile.read_text())]
    for image, match in pinned:
        if match is None:
            continue
        version = Version(match["version"])
        fixed = TARFILE_FIXED.get(f"{version.major}.{version.minor}")
        assert fixed is not None and version >= Version(fixed), (
            f"{dockerfile.name}: FROM {image} predates the tarfile security fixes; use at least {fixed}")
    assert any(match for _, match in pinned) or "python:" not in dockerfile.read_text()


def test_the_operator_image_installs_the_operator_extra():
    """The operator image installs its dependencies by hand (not the runtime's): every requirement of
    pyproject's ``operator`` extra must be on that line (cryptography was missing: the sidecar webhook's
    self-managed certificates could not be issued, and no pod of an injected namespace was admitted)."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["operator"]
    wanted = {re.split(r"[<>=!~\[ ;]", requirement, maxsplit=1)[0].lower() for requirement in extra}
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile.operator").read_text())
    installed = {match.lower() for line in re.findall(r"pip install ([^&\n]*)", text)
                 for match in re.findall(r'"([A-Za-z0-9_.-]+)[<>=!~]', line)}
    assert wanted <= installed, f"Dockerfile.operator does not install {sorted(wanted - installed)}"


def test_an_image_with_the_gpu_extra_keeps_only_onnxruntime_gpu():
    """onnxruntime and onnxruntime-gpu install into one package directory; with both, the CUDA provider
    may be missing (the CPU wheel unpacked last) and GPU models would run on the CPU or fail to place."""
    for dockerfile in DOCKERFILES:
        text = re.sub(r"\\\n", " ", dockerfile.read_text())
        if "gpu" not in " ".join(re.findall(r"EXTRAS=\"?\[([^\]]*)\]", text)):
            continue
        assert re.search(r"pip uninstall -y onnxruntime\b", text), f"{dockerfile.name}: onnxruntime stays installed"
        assert re.search(r'pip install --no-deps "onnxruntime-gpu', text), f"{dockerfile.name}: no onnxruntime-gpu"
        assert "'CUDAExecutionProvider' in p" in text, f"{dockerfile.name}: the build does not check the provider"
