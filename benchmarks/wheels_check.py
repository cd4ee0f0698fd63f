"""Check a folder of wheels carried to the device machine (``.whl``, see benchmarks/gpu_session.sh) against the
packages that machine already has: one version per package, and every requirement of every wheel (and of the
named roots) met either there or in the folder. Reads the wheels' METADATA; installs nothing.

    python3 benchmarks/wheels_check.py .whl --roots trl datasets openenv uvicorn websockets \
        --skip gradio                      # openenv imports its gradio web UI only if present

The device's package list is the names in /work/.library/device/KINDS.md's section "Python packages already
there" (``--device-list`` for another file of names). Versions on the device are not known here: a requirement
met by a device package is met by name only (printed with ``-v``, to check with ``pip show`` there). Exit status
1 when something is missing or doubled."""

from __future__ import annotations

import argparse
import re
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

KINDS = Path("/work/.library/device/KINDS.md")
# Python 3.12 on x86-64 Linux, as the device machine's python3.
MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "implementation_name": "cpython", "platform_python_implementation": "CPython",
           "os_name": "posix", "platform_machine": "x86_64"}


def device_packages(path: Path) -> set[str]:
    text = path.read_text()
    if "## Python packages already there" in text:
        text = text.split("## Python packages already there", 1)[1].split("Packages:", 1)[1].strip().splitlines()[0]
    return {canonicalize_name(name.strip().rstrip(".")) for name in re.split(r"[,\s]+", text) if name.strip(" .")}


def wheel_requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(archive.read(name).decode())
    return [Requirement(r) for r in metadata.get_all("Requires-Dist") or []]


def applies(requirement: Requirement, extras: set[str]) -> bool:
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate(dict(MARKERS, extra=e)) for e in extras | {""})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="the wheels (e.g. .whl)")
    parser.add_argument("--roots", nargs="*", default=[], help="packages the run imports (must be in the folder or "
                                                               "on the device)")
    parser.add_argument("--skip", nargs="*", default=[], help="requirements left out on purpose (optional at run time)")
    parser.add_argument("--device-list", type=Path, default=KINDS)
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)

    device = device_packages(args.device_list)
    skip = {canonicalize_name(n) for n in args.skip}
    wheels: dict[str, list[tuple[str, Path]]] = {}
    for wheel in sorted(args.folder.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(wheel.name)
        wheels.setdefault(name, []).append((str(version), wheel))
    problems = [f"{name}: {len(found)} versions ({', '.join(v for v, _ in found)}): keep one"
                for name, found in wheels.items() if len(found) > 1]
    problems += [f"{name}: carried but the device has it already" for name in wheels if name in device]

    # Every wheel's own requirements and the roots; a requirement naming extras adds what those extras need.
    wanted: list[tuple[Requirement, str]] = [(Requirement(r), "(root)") for r in args.roots]
    extras_of: dict[str, set[str]] = {}
    for name, found in wheels.items():
        wanted += [(r, name) for r in wheel_requirements(found[0][1]) if applies(r, set())]
    done: set[tuple[str, str, frozenset]] = set()
    on_device: dict[str, set[str]] = {}
    while wanted:
        requirement, by = wanted.pop()
        name = canonicalize_name(requirement.name)
        key = (name, by, frozenset(requirement.extras))
        if key in done or name in skip:
            continue
        done.add(key)
        if name in wheels:
            version = wheels[name][0][0]
            if requirement.specifier and not requirement.specifier.contains(version, prereleases=True):
                problems.append(f"{by} needs {requirement}, the folder has {name} {version}")
            new = set(requirement.extras) - extras_of.setdefault(name, set())
            if new:
                extras_of[name] |= new
                wanted += [(r, name) for r in wheel_requirements(wheels[name][0][1]) if applies(r, extras_of[name])]
        elif name in device:
            on_device.setdefault(name, set()).add(f"{by}: {requirement.specifier or 'any'}")
        else:
            problems.append(f"{by} needs {requirement}: neither in the folder nor on the device")

    size = sum(w.stat().st_size for found in wheels.values() for _, w in found)
    print(f"{sum(len(f) for f in wheels.values())} wheels, {size / 2**20:.1f} MiB; {len(on_device)} requirements met "
          f"on the device by name; skipped on purpose: {', '.join(sorted(skip)) or 'none'}")
    if args.verbose:
        for name in sorted(on_device):
            print(f"  device {name}: {'; '.join(sorted(on_device[name]))}")
    for problem in problems:
        print("MISSING " + problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
