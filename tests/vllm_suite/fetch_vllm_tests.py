"""Fetches vLLM 0.33.0's offloading tests from its source distribution on PyPI.

vLLM's wheel ships no tests; its sdist does. This script reads the package index's
simple page for the sdist's URL, downloads it, checks its sha256 against the digest
pinned here (and the one the index gives), and extracts only the offloading test
folders (with the package ``__init__``/helper files they import) into a git-ignored
folder. ``pip download`` cannot be used: it builds the
sdist to read its metadata, which needs CUDA toolchains.

    python tests/vllm_suite/fetch_vllm_tests.py            # from PyPI
    python tests/vllm_suite/fetch_vllm_tests.py --tarball vllm-0.33.0.tar.gz

Exit status 0 when the tests are in place, 1 when they could not be fetched (the
message says why; the suite then skips and says so).
"""

from __future__ import annotations

import argparse
import hashlib
import html.parser
import io
import pathlib
import shutil
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request

VERSION = "0.33.0"
SDIST = f"vllm-{VERSION}.tar.gz"
# The sdist's sha256 as published on PyPI (2026-11): a different file is refused.
SDIST_SHA256 = "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"
INDEX_URL = "https://pypi.org/simple/vllm/"
ROOT = pathlib.Path(__file__).resolve().parents[2]
# The suite finds the tests here (or where JAX_KVOFFLOAD_VLLM_TESTS points).
DEFAULT_DEST = ROOT / ".vllm-tests" / VERSION

# Paths inside the sdist's tests/ that are extracted: whole folders, then single files.
_FOLDERS = ("v1/kv_offload/", "v1/kv_connector/unit/offloading_connector/")
_FILES = (
    "__init__.py",
    "v1/__init__.py",
    "v1/kv_connector/__init__.py",
    "v1/kv_connector/unit/__init__.py",
    "v1/kv_connector/unit/conftest.py",
    "v1/kv_connector/unit/utils.py",
)


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self.hrefs.extend(v for k, v in attrs if k == "href" and v)


def sdist_url(index_html: str, base: str = INDEX_URL) -> tuple[str, str]:
    """The sdist's absolute URL and the sha256 the index gives for it."""
    parser = _Links()
    parser.feed(index_html)
    for href in parser.hrefs:
        url, _, fragment = urllib.parse.urljoin(base, href).partition("#")
        if url.rsplit("/", 1)[-1] == SDIST:
            algo, _, digest = fragment.partition("=")
            if algo != "sha256" or len(digest) != 64:
                raise ValueError(f"the index lists {SDIST} without a sha256: {href!r}")
            return url, digest
    raise ValueError(f"{base} lists no {SDIST}")


def check_digest(data: bytes) -> None:
    actual = hashlib.sha256(data).hexdigest()
    if actual != SDIST_SHA256:
        raise ValueError(f"{SDIST}: sha256 {actual} is not the pinned {SDIST_SHA256}")


def _download(url: str, timeout: float) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


def _wanted(relative: str) -> bool:
    return relative in _FILES or any(relative.startswith(f) for f in _FOLDERS)


def extract(data: bytes, dest: pathlib.Path) -> int:
    """Extracts the wanted test files into ``dest/tests``; returns how many."""
    prefix = f"vllm-{VERSION}/tests/"
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".vllm-tests-", dir=dest.parent))
    count = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            for member in tar.getmembers():
                if not member.isfile() or not member.name.startswith(prefix):
                    continue
                relative = member.name[len(prefix) :]
                if ".." in relative.split("/") or not _wanted(relative):
                    continue
                target = tmp / "tests" / relative
                target.parent.mkdir(parents=True, exist_ok=True)
                source = tar.extractfile(member)
                if source is None:  # not a regular file after all
                    continue
                target.write_bytes(source.read())
                count += 1
        if count == 0:
            raise ValueError(f"{SDIST} holds none of the expected test files")
        (tmp / "SHA256").write_text(SDIST_SHA256 + "\n")
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)  # atomic: a half-extracted tree is never seen
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tarball", type=pathlib.Path, help=f"a local {SDIST} (no network; still verified)"
    )
    parser.add_argument("--dest", type=pathlib.Path, default=DEFAULT_DEST)
    parser.add_argument("--index-url", default=INDEX_URL)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    marker = args.dest / "SHA256"
    if marker.is_file() and marker.read_text().strip() == SDIST_SHA256:
        print(f"vLLM {VERSION} tests already in {args.dest / 'tests'}")
        return 0
    try:
        if args.tarball:
            data = args.tarball.read_bytes()
        else:
            page = _download(args.index_url, args.timeout).decode()
            url, digest = sdist_url(page, args.index_url)
            if digest != SDIST_SHA256:
                raise ValueError(f"the index gives sha256 {digest} for {SDIST}, not {SDIST_SHA256}")
            data = _download(url, args.timeout)
        check_digest(data)
        args.dest.parent.mkdir(parents=True, exist_ok=True)
        count = extract(data, args.dest)
    except (OSError, ValueError, tarfile.TarError) as exc:
        print(f"vLLM {VERSION} tests not fetched: {exc}", file=sys.stderr)
        return 1
    print(f"vLLM {VERSION} tests: {count} files in {args.dest / 'tests'} (sha256 verified)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
