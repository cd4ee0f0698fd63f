"""Give a virtualenv this interpreter's torch (the pinned CPU wheel, already unpacked and byte-compiled) by hard
links, not a second ``pip install`` of the same wheel (about a minute on CI's 2 cores, most of it unpacking and
byte-compiling 1 GB). The links carry torch's dist-info too, so pip in the venv sees torch as installed and adds
only its dependencies. Files are linked, never symlinked: pip uninstalling the venv's torch then removes the
venv's names only. Where a link cannot be made (another filesystem) the file is copied.

Usage: python3 .ci/link_torch.py VENV VERSION
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib.metadata import distribution
from pathlib import Path


def main(venv: Path, version: str) -> None:
    dist = distribution("torch")
    if dist.version.split("+")[0] != version:
        sys.exit(f"link_torch: this interpreter has torch {dist.version}, not {version}: install that first")
    purelib = Path(subprocess.run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  check=True, capture_output=True, text=True).stdout.strip())
    linked = copied = 0
    for file in dist.files or ():
        source = Path(dist.locate_file(file))
        if file.parts[0] == "..":  # a console script (torchrun): rewritten for the venv's python
            target = venv / "bin" / source.name
            lines = source.read_text().splitlines(keepends=True)
            target.write_text(f"#!{venv / 'bin' / 'python'}\n" + "".join(lines[1:]))
            target.chmod(0o755)
            continue
        if not source.is_file():  # RECORD lists .pyc files that may not have been written
            continue
        target = purelib / file
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source, target)
            linked += 1
        except OSError:
            shutil.copy2(source, target)
            copied += 1
    print(f"link_torch: torch {dist.version} into {purelib}: {linked} files linked, {copied} copied")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.strip().splitlines()[-1])
    main(Path(sys.argv[1]), sys.argv[2])
