"""Fetch Multi30k or WMT14 EN-DE from where their authors publish them, verified.

    python -m minitransformer.data.download multi30k --dest data/multi30k
    python -m minitransformer.data.download wmt14 --dest data/wmt14

Sources
    multi30k  github.com/multi30k/dataset, data/task1/raw/{train,val,test_2016_flickr}.{en,de}.gz,
              fetched from raw.githubusercontent.com at commit c9be912 (the last commit to
              change these files), so the pinned checksums stay valid.
    wmt14     www.statmt.org: the WMT13 Europarl v7 and Common Crawl archives and the WMT14
              News Commentary v9 archive (together the ~4.5M pairs the paper trains on, as
              tensor2tensor and fairseq assemble them), dev.tgz (newstest2013) and
              test-full.tgz (newstest2014, 3,003 sentences). The files ``corpus.load_wmt14``
              reads are extracted from them into DIR.

Checksums, and where each comes from (no dataset here publishes its own):
    multi30k          sha256 of each file, computed here from copies whose git blob ids equal
                      the ones in the repository's tree at the pinned commit; git itself
                      guarantees those blobs, so the sha256 identify the published bytes.
    commoncrawl, nc-v9  sha1 and size from gluon-nlp's scripts/datasets/url_checksums/wmt.txt.
    test-full.tgz     md5 from sacreBLEU's data set registry ("wmt14/full").
    europarl, dev.tgz no published checksum known: trust on first use. The sha256 of the
                      first download is recorded in DIR/MANIFEST.json, and later runs check
                      the file against it; the first download itself is not verified.
MANIFEST.json records every file's url, size, sha256 and which of these vouched for it.

Downloads go to NAME.part, resume from its size with an HTTP Range request after an
interruption (up to --retries times in a row without progress), and are renamed to NAME
only once their checksum matches; a mismatching download is deleted, never left looking
finished. A file already in DIR is checked, not fetched again; a mismatching one is moved
to NAME.corrupt and fetched anew. Offline, the error lists each URL and where its file goes:
copy them there by any means and run the same command, which verifies and extracts them.

The base URL can be overridden (a mirror, or a test server): --base-url, or the
environment variable MINITRANSFORMER_MULTI30K_URL / MINITRANSFORMER_WMT14_URL. Files keep
their paths below it (multi30k: train.en.gz; wmt14: wmt13/..., wmt14/...).
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import logging
import os
import re
import sys
import tarfile
import time
import urllib.error
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from tqdm import tqdm

from .. import cli
from ..files import atomic_write, naming
from .corpus import missing_files

logger = logging.getLogger(__name__)

_CHUNK = 1 << 20
_TOFU = ("trust on first use: no published checksum is known; this sha256 was recorded at "
         "the first download, not checked against the source")


class DownloadError(RuntimeError):
    """A file could not be fetched (the message says what to do instead)."""


class ChecksumError(DownloadError):
    """A fetched file's bytes are not the published ones; it was deleted."""


@dataclass(frozen=True)
class RemoteFile:
    """One file of a data set.

    path: below the base URL; the local copy is DIR/<last component>.
    checksum: "algorithm:hexdigest" (sha256, sha1, md5), or None for trust on first use.
    checksum_source: who vouches for the checksum (goes into MANIFEST.json).
    extract: (archive member, local name) pairs written into DIR after verification.
    """

    path: str
    size: int | None = None
    checksum: str | None = None
    checksum_source: str = _TOFU
    extract: tuple[tuple[str, str], ...] = ()

    @property
    def name(self) -> str:
        return PurePosixPath(self.path).name


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    base_url: str
    env_var: str
    files: tuple[RemoteFile, ...]


_MULTI30K_SOURCE = ("sha256 of the file whose git blob id matches multi30k/dataset's tree at "
                    "commit c9be912dc05a3ebf9ae5bb5f7f58c1791cda43ab")
_GLUON = "sha1 and size from gluon-nlp scripts/datasets/url_checksums/wmt.txt"


def _multi30k(name: str, size: int, sha256: str) -> RemoteFile:
    return RemoteFile(name, size, f"sha256:{sha256}", _MULTI30K_SOURCE)


def _pair(member_dir: str, stem: str, suffix: str = "") -> tuple[tuple[str, str], ...]:
    return tuple((f"{member_dir}{stem}.{lang}{suffix}", f"{stem}.{lang}{suffix}")
                 for lang in ("en", "de"))


DATASETS = {
    "multi30k": DatasetSpec(
        "multi30k",
        "https://raw.githubusercontent.com/multi30k/dataset/"
        "c9be912dc05a3ebf9ae5bb5f7f58c1791cda43ab/data/task1/raw",
        "MINITRANSFORMER_MULTI30K_URL",
        (
            _multi30k("train.en.gz", 568929,
                      "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f"),
            _multi30k("train.de.gz", 637044,
                      "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6"),
            _multi30k("val.en.gz", 21650,
                      "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28"),
            _multi30k("val.de.gz", 24681,
                      "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a"),
            _multi30k("test_2016_flickr.en.gz", 21077,
                      "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9"),
            _multi30k("test_2016_flickr.de.gz", 22890,
                      "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8"),
        ),
    ),
    "wmt14": DatasetSpec(
        "wmt14",
        "https://www.statmt.org",
        "MINITRANSFORMER_WMT14_URL",
        (
            RemoteFile("wmt13/training-parallel-europarl-v7.tgz",
                       extract=_pair("training/", "europarl-v7.de-en")),
            RemoteFile("wmt13/training-parallel-commoncrawl.tgz", 918311367,
                       "sha1:1c0ad85f0ebaf1d543acb009607205f5dae6627d", _GLUON,
                       extract=_pair("", "commoncrawl.de-en")),
            RemoteFile("wmt14/training-parallel-nc-v9.tgz", 80418416,
                       "sha1:c7ae7f50cd45c2f3014d78ddba25a4a8a851e27a", _GLUON,
                       extract=_pair("training/", "news-commentary-v9.de-en")),
            RemoteFile("wmt14/dev.tgz", extract=_pair("dev/", "newstest2013")),
            RemoteFile("wmt14/test-full.tgz", None, "md5:a8cd784e006feb32ac6f3d9ec7eb389a",
                       "md5 from sacreBLEU's data set registry (wmt14/full)",
                       extract=_pair("test-full/", "newstest2014-deen-src", ".sgm")
                       + _pair("test-full/", "newstest2014-deen-ref", ".sgm")),
        ),
    ),
}


class _Interrupted(Exception):
    """A transfer that ended early or failed on the network: worth resuming."""


def _digests(path: Path, algorithms: set[str]) -> dict[str, str]:
    hashes = {a: hashlib.new(a) for a in algorithms}
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            for h in hashes.values():
                h.update(chunk)
    return {a: h.hexdigest() for a, h in hashes.items()}


class _Manifest:
    """DIR/MANIFEST.json: what was fetched, from where, and what vouched for it."""

    def __init__(self, path: Path, dataset: str):
        self.path = path
        self.data = {"dataset": dataset, "files": {}}
        if path.is_file():
            self.data = json.loads(path.read_text())

    def entry(self, name: str) -> dict | None:
        return self.data["files"].get(name)

    def record(self, name: str, entry: dict) -> None:
        self.data["files"][name] = entry
        with atomic_write(self.path) as f:
            f.write(json.dumps(self.data, indent=2, sort_keys=True) + "\n")


def _verify(path: Path, file: RemoteFile, manifest: _Manifest, url: str) -> dict:
    """Check a complete file against its pinned checksum, or its manifest record under
    trust on first use; returns the manifest entry to record. Raises ChecksumError."""
    actual_size = path.stat().st_size
    if file.size is not None and actual_size != file.size:
        raise ChecksumError(
            f"{file.name} from {url}: expected {file.size} bytes, got {actual_size}"
        )
    algorithm, expected = file.checksum.split(":") if file.checksum else ("sha256", None)
    source = file.checksum_source
    recorded = manifest.entry(file.name)
    if expected is None and recorded is not None:
        expected, source = recorded["sha256"], recorded["checked_against"]
    digests = _digests(path, {algorithm, "sha256"})
    if expected is not None and digests[algorithm] != expected:
        raise ChecksumError(
            f"checksum mismatch for {file.name} from {url}: expected {algorithm} {expected}, "
            f"got {digests[algorithm]} (checksum source: {source})"
        )
    if expected is None:
        logger.warning("%s: %s; recording sha256 %s", file.name, _TOFU, digests["sha256"])
    return {"url": url, "size": actual_size, "sha256": digests["sha256"],
            "checked_against": source}


def _fetch(url: str, part: Path, file: RemoteFile, *, retries: int, retry_wait: float,
           timeout: float, progress: bool) -> None:
    """Bring ``part`` to the whole file at ``url``, resuming from its current size."""
    failures = 0
    with tqdm(total=file.size, unit="B", unit_scale=True, unit_divisor=1024, desc=file.name,
              disable=not progress, leave=False) as bar:
        while True:
            offset = part.stat().st_size if part.exists() else 0
            if file.size is not None and offset == file.size:
                return
            bar.reset(total=file.size)
            bar.update(offset)
            try:
                _transfer(url, part, offset, timeout, bar)
                return
            except _Interrupted as e:
                if part.exists() and part.stat().st_size > offset:
                    failures = 0  # it made progress: only count attempts that go nowhere
                failures += 1
                if failures > retries:
                    raise DownloadError(f"could not download {url}: {e}") from None
                logger.warning("download of %s failed (%s) with %d bytes in hand; retrying "
                               "(attempt %d of %d)", file.name, e,
                               part.stat().st_size if part.exists() else 0, failures, retries)
                time.sleep(retry_wait * failures)


def _transfer(url: str, part: Path, offset: int, timeout: float, bar: tqdm) -> None:
    """One HTTP request that appends the rest of the file to ``part`` (from ``offset``)."""
    headers = {"User-Agent": "minitransformer-download/0.1"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    try:
        response = urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                          timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and offset:
            return  # nothing past our offset: the .part is already whole; the checksum decides
        if e.code >= 500:
            raise _Interrupted(f"HTTP {e.code} {e.reason}") from None  # the server may recover
        raise DownloadError(f"{url}: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        raise _Interrupted(getattr(e, "reason", e)) from None
    with response:
        mode = "wb"
        if offset and response.status == 206:
            match = re.match(r"bytes (\d+)-", response.headers.get("Content-Range", ""))
            if match is None or int(match.group(1)) != offset:
                raise DownloadError(f"{url}: asked for bytes from {offset}, server sent "
                                    f"Content-Range {response.headers.get('Content-Range')!r}")
            mode = "ab"
        elif offset:  # 200: the server ignores Range; start over
            offset = 0
        length = response.headers.get("Content-Length")
        length = int(length) if length is not None else None
        if length is not None:
            bar.reset(total=offset + length)
            bar.update(offset)
        received = 0
        with naming(part), open(part, mode) as out:
            while True:
                try:  # the network's failures only: a full disk is no reason to retry
                    chunk = response.read(_CHUNK)
                except (OSError, http.client.HTTPException) as e:
                    raise _Interrupted(e) from None
                if not chunk:
                    break
                out.write(chunk)
                received += len(chunk)
                bar.update(len(chunk))
        if length is not None and received < length:
            raise _Interrupted(f"connection closed after {received} of {length} bytes")


def _extract(archive: Path, members: tuple[tuple[str, str], ...], dest: Path) -> None:
    """Write the named members of a tar archive to DIR/<local name>, each atomically."""
    wanted = dict(members)
    try:
        with tarfile.open(archive, "r:*") as tar:
            for member in tar:  # one pass: a .tgz can only be read front to back
                name = member.name.removeprefix("./")
                if name not in wanted or not member.isfile():
                    continue
                target = dest / wanted.pop(name)
                with tar.extractfile(member) as src, atomic_write(target, "wb") as out:
                    while chunk := src.read(_CHUNK):
                        out.write(chunk)
                logger.info("extracted %s from %s", target.name, archive.name)
    except (tarfile.TarError, EOFError, zlib.error) as e:
        raise DownloadError(f"{archive} is not a readable tar archive ({e})") from None
    if wanted:
        raise DownloadError(f"{archive} lacks the expected members: {', '.join(sorted(wanted))}")


def _offline_help(spec: DatasetSpec, base: str, dest: Path) -> str:
    lines = [f"If this machine cannot reach {base}, fetch these files elsewhere, put them "
             f"at the paths shown, and run this command again (it verifies"
             + (" and extracts" if any(f.extract for f in spec.files) else "") + " them):"]
    lines += [f"  {base}/{f.path}\n      -> {dest / f.name}"
              for f in spec.files if not (dest / f.name).is_file()]
    return "\n".join(lines)


def download(dataset: str | DatasetSpec, dest: str | Path, *, base_url: str | None = None,
             retries: int = 3, retry_wait: float = 1.0, timeout: float = 60.0,
             progress: bool = True, only: set[str] | None = None) -> Path:
    """Fetch, verify (and for WMT14 extract) a data set into ``dest``; returns ``dest``.

    ``dataset`` is "multi30k", "wmt14" or a ``DatasetSpec``. ``base_url`` overrides the
    official location (else the spec's environment variable, else the default). ``only``:
    the names of the spec's files to handle (default: all of them).
    Raises ``ChecksumError`` for bytes that are not the published ones, ``DownloadError``
    for anything else that stops it (its message says where to put the files by hand).
    """
    if isinstance(dataset, str) and dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; expected one of {sorted(DATASETS)}")
    spec = DATASETS[dataset] if isinstance(dataset, str) else dataset
    base = (base_url or os.environ.get(spec.env_var) or spec.base_url).rstrip("/")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    manifest = _Manifest(dest / "MANIFEST.json", spec.name)
    for file in spec.files:
        if only is not None and file.name not in only:
            continue
        url = f"{base}/{file.path}"
        target = dest / file.name
        fresh = False
        if target.is_file():
            try:
                entry = _verify(target, file, manifest, url)
            except ChecksumError as e:
                target.replace(target.with_name(target.name + ".corrupt"))
                logger.warning("%s; moved it to %s.corrupt and fetching it again", e, file.name)
        if not target.is_file():
            part = target.with_name(target.name + ".part")
            try:
                _fetch(url, part, file, retries=retries, retry_wait=retry_wait,
                       timeout=timeout, progress=progress)
            except DownloadError as e:
                raise DownloadError(f"{e}\n{_offline_help(spec, base, dest)}") from None
            try:
                entry = _verify(part, file, manifest, url)
            except ChecksumError as e:
                part.unlink()
                raise ChecksumError(f"{e}; the download was deleted, run again to retry") from None
            os.replace(part, target)
            fresh = True
            logger.info("fetched %s", target)
        manifest.record(file.name, entry)
        if file.extract and (fresh or any(not (dest / n).is_file() for _, n in file.extract)):
            _extract(target, file.extract, dest)
    return dest


def ensure_dataset(name: str, data_dir: str | Path, **kwargs) -> Path:
    """``data_dir`` if it already holds every file ``corpus.load_corpus(name, ...)`` reads
    (no network, no hashing), else downloads the missing ones: the files present are the
    caller's and are neither checked nor replaced."""
    missing = {p.name for p in missing_files(name, data_dir)}
    if not missing:
        return Path(data_dir)
    # A download is needed if it is a missing file (Multi30k: X.gz for X) or extracts to one.
    needed = {f.name for f in DATASETS[name].files
              if missing & ({local for _, local in f.extract} or {f.name.removesuffix(".gz")})}
    logger.info("%s lacks %s; downloading %s", data_dir, ", ".join(sorted(missing)), ", ".join(sorted(needed)))
    return download(name, data_dir, only=needed, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = cli.ArgumentParser(
        prog="python -m minitransformer.data.download",
        description="Download Multi30k (task 1, EN/DE) or WMT14 EN-DE from the official "
                    "sources, verify checksums, resume partial files, extract what the "
                    "readers need.",
        epilog="Environment: MINITRANSFORMER_MULTI30K_URL, MINITRANSFORMER_WMT14_URL override "
               "the base URL. Checksum provenance is recorded in DEST/MANIFEST.json.",
    )
    parser.add_argument("dataset", choices=sorted(DATASETS), help="the data set to fetch")
    parser.add_argument("--dest", required=True, type=cli.output_folder, help="directory for the files")
    parser.add_argument("--base-url", help="fetch from here instead of the official source")
    parser.add_argument("--retries", type=cli.integer(0), default=3,
                        help="resume attempts in a row without progress (0: none, the first "
                             "failure ends the download)")
    parser.add_argument("--timeout", type=cli.real(0.0, 86400.0, low_open=True), default=60.0,
                        help="seconds to wait on a silent connection")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        dest = download(args.dataset, args.dest, base_url=args.base_url, retries=args.retries,
                        timeout=args.timeout, progress=not args.no_progress)
    except DownloadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{args.dataset} is ready in {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
