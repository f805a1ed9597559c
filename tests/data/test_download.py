"""The downloader against an HTTP server on 127.0.0.1 that each test starts.

No test may reach another address: ``loopback_only`` fails any connection elsewhere.
"""

import dataclasses
import gzip
import hashlib
import io
import ipaddress
import json
import re
import socket
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from minitransformer.data import load_multi30k, load_wmt14, missing_files
from minitransformer.data.download import (
    DATASETS, ChecksumError, DatasetSpec, DownloadError, RemoteFile, download, ensure_dataset,
    main,
)

FAST = dict(retry_wait=0.0, timeout=10.0, progress=False)


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch):
    real_connect = socket.socket.connect

    def connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            assert ipaddress.ip_address(address[0]).is_loopback, f"test tried to reach {address}"
        return real_connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    for spec in DATASETS.values():
        monkeypatch.delenv(spec.env_var, raising=False)


class FileServer:
    """Serves ``files`` (URL path -> bytes) with HTTP Range support, and can misbehave:
    ``cut_once`` paths send half their body on the first request and hang up;
    ``ignore_range`` paths answer every request with the whole file (200);
    ``unavailable_once`` paths answer their first request with 503."""

    def __init__(self):
        self.files, self.cut_once, self.ignore_range = {}, set(), set()
        self.unavailable_once = set()
        self.requests = []  # (path, Range header or None)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                rng = self.headers.get("Range")
                server.requests.append((self.path, rng))
                body = server.files.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                if self.path in server.unavailable_once:
                    server.unavailable_once.discard(self.path)
                    self.send_error(503)
                    return
                start = 0
                if rng and self.path not in server.ignore_range:
                    start = int(re.fullmatch(r"bytes=(\d+)-", rng).group(1))
                    if start >= len(body):
                        self.send_error(416)
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(len(body) - start))
                self.end_headers()
                if self.path in server.cut_once:
                    server.cut_once.discard(self.path)
                    self.wfile.write(body[start:start + (len(body) - start) // 2])
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.wfile.write(body[start:])

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = FileServer()
    yield s
    s.close()


def random_bytes(n):
    return np.random.default_rng().integers(0, 256, size=n, dtype=np.uint8).tobytes()


def toy_spec(contents: dict[str, bytes], algorithm="sha256", tofu=()) -> DatasetSpec:
    """A data set of the given files, each pinned by its real checksum unless in ``tofu``."""
    files = tuple(
        RemoteFile(path) if path in tofu else
        RemoteFile(path, len(data), f"{algorithm}:{hashlib.new(algorithm, data).hexdigest()}",
                   "computed by the test")
        for path, data in contents.items())
    return DatasetSpec("toy", "http://127.0.0.1:9/unused", "MINITRANSFORMER_TOY_URL", files)


def serve(server, contents, prefix="/toy"):
    for path, data in contents.items():
        server.files[f"{prefix}/{path}"] = data
    return server.url + prefix


def test_fetches_and_verifies_into_dest(server, tmp_path):
    contents = {"a/one.bin": random_bytes(300_000), "two.txt": random_bytes(1234)}
    base = serve(server, contents)
    for algorithm in ("sha256", "sha1", "md5"):
        dest = tmp_path / algorithm
        download(toy_spec(contents, algorithm), dest, base_url=base, **FAST)
        assert (dest / "one.bin").read_bytes() == contents["a/one.bin"]
        assert (dest / "two.txt").read_bytes() == contents["two.txt"]
        assert not list(dest.glob("*.part"))
        manifest = json.loads((dest / "MANIFEST.json").read_text())["files"]
        assert manifest["one.bin"]["sha256"] == hashlib.sha256(contents["a/one.bin"]).hexdigest()
        assert manifest["one.bin"]["url"] == f"{base}/a/one.bin"
    # Present and verified: nothing is fetched again.
    before = len(server.requests)
    download(toy_spec(contents), tmp_path / "sha256", base_url=base, **FAST)
    assert len(server.requests) == before


def test_corrupted_file_is_rejected_and_not_left_in_place(server, tmp_path):
    good = {"one.bin": random_bytes(50_000), "two.bin": random_bytes(5_000)}
    spec = toy_spec(good)
    bad = bytearray(good["two.bin"])
    bad[int(np.random.default_rng().integers(len(bad)))] ^= 0xFF  # one flipped byte, same size
    base = serve(server, {"one.bin": good["one.bin"], "two.bin": bytes(bad)})
    with pytest.raises(ChecksumError) as err:
        download(spec, tmp_path, base_url=base, **FAST)
    msg = str(err.value)
    assert "two.bin" in msg and f"{base}/two.bin" in msg
    assert hashlib.sha256(good["two.bin"]).hexdigest() in msg
    assert hashlib.sha256(bad).hexdigest() in msg
    assert not (tmp_path / "two.bin").exists() and not (tmp_path / "two.bin.part").exists()
    assert (tmp_path / "one.bin").read_bytes() == good["one.bin"]
    # The source is fixed: the next run fetches the file again and succeeds.
    server.files["/toy/two.bin"] = good["two.bin"]
    download(spec, tmp_path, base_url=base, **FAST)
    assert (tmp_path / "two.bin").read_bytes() == good["two.bin"]


def test_wrong_size_is_rejected(server, tmp_path):
    data = random_bytes(10_000)
    base = serve(server, {"f.bin": data[:-100]})
    with pytest.raises(ChecksumError, match="expected 10000 bytes, got 9900"):
        download(toy_spec({"f.bin": data}), tmp_path, base_url=base, **FAST)
    assert not list(tmp_path.glob("f.bin*"))


def test_interrupted_transfer_resumes_with_range(server, tmp_path, capsys):
    data = random_bytes(2_000_000)
    base = serve(server, {"big.bin": data})
    server.cut_once.add("/toy/big.bin")
    download(toy_spec({"big.bin": data}), tmp_path, base_url=base, retry_wait=0.0,
             timeout=10.0, progress=True)
    assert (tmp_path / "big.bin").read_bytes() == data
    assert server.requests == [("/toy/big.bin", None),
                               ("/toy/big.bin", f"bytes={len(data) // 2}-")]
    assert "big.bin" in capsys.readouterr().err  # the tqdm bar


def test_partial_file_from_an_earlier_run_is_resumed(server, tmp_path):
    data = random_bytes(100_000)
    base = serve(server, {"f.bin": data})
    cut = int(np.random.default_rng().integers(1, len(data)))
    (tmp_path / "f.bin.part").write_bytes(data[:cut])
    download(toy_spec({"f.bin": data}), tmp_path, base_url=base, **FAST)
    assert (tmp_path / "f.bin").read_bytes() == data
    assert server.requests == [("/toy/f.bin", f"bytes={cut}-")]


def test_server_ignoring_range_restarts_the_file(server, tmp_path):
    data = random_bytes(30_000)
    base = serve(server, {"f.bin": data})
    server.ignore_range.add("/toy/f.bin")
    (tmp_path / "f.bin.part").write_bytes(data[:1000])
    download(toy_spec({"f.bin": data}), tmp_path, base_url=base, **FAST)
    assert (tmp_path / "f.bin").read_bytes() == data


def test_complete_part_file_is_verified_not_refetched(server, tmp_path):
    data = random_bytes(20_000)
    base = serve(server, {"f.bin": data})
    (tmp_path / "f.bin.part").write_bytes(data)
    download(toy_spec({"f.bin": data}, tofu={"f.bin"}), tmp_path, base_url=base, **FAST)
    assert (tmp_path / "f.bin").read_bytes() == data
    assert server.requests == [("/toy/f.bin", f"bytes={len(data)}-")]  # answered 416


def test_corrupt_partial_file_fails_the_checksum_then_recovers(server, tmp_path):
    data = random_bytes(40_000)
    base = serve(server, {"f.bin": data})
    (tmp_path / "f.bin.part").write_bytes(random_bytes(15_000))  # not a prefix of the file
    spec = toy_spec({"f.bin": data})
    with pytest.raises(ChecksumError, match="checksum mismatch for f.bin"):
        download(spec, tmp_path, base_url=base, **FAST)
    assert not list(tmp_path.glob("f.bin*"))
    download(spec, tmp_path, base_url=base, **FAST)
    assert (tmp_path / "f.bin").read_bytes() == data


def test_damaged_file_in_dest_is_moved_aside_and_refetched(server, tmp_path):
    data = random_bytes(8_000)
    base = serve(server, {"f.bin": data})
    damaged = random_bytes(8_000)
    (tmp_path / "f.bin").write_bytes(damaged)
    download(toy_spec({"f.bin": data}), tmp_path, base_url=base, **FAST)
    assert (tmp_path / "f.bin").read_bytes() == data
    assert (tmp_path / "f.bin.corrupt").read_bytes() == damaged


def test_trust_on_first_use_records_then_enforces(server, tmp_path):
    first = random_bytes(6_000)
    base = serve(server, {"f.bin": first})
    spec = toy_spec({"f.bin": first}, tofu={"f.bin"})
    download(spec, tmp_path, base_url=base, **FAST)
    entry = json.loads((tmp_path / "MANIFEST.json").read_text())["files"]["f.bin"]
    assert entry["sha256"] == hashlib.sha256(first).hexdigest()
    assert "trust on first use" in entry["checked_against"]
    # The source changes under the same name: the recorded checksum catches it.
    (tmp_path / "f.bin").unlink()
    server.files["/toy/f.bin"] = random_bytes(6_000)
    with pytest.raises(ChecksumError, match=hashlib.sha256(first).hexdigest()):
        download(spec, tmp_path, base_url=base, **FAST)
    assert not (tmp_path / "f.bin").exists()


def closed_port_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens there now


def test_offline_says_which_files_to_put_where(tmp_path, capsys):
    base = closed_port_url()
    with pytest.raises(DownloadError) as err:
        download("wmt14", tmp_path, base_url=base, retries=1, **FAST)
    msg = str(err.value)
    for file in DATASETS["wmt14"].files:
        assert f"{base}/{file.path}" in msg and str(tmp_path / file.name) in msg
    assert "run this command again" in msg

    assert main(["multi30k", "--dest", str(tmp_path / "m"), "--base-url", base,
                 "--retries", "0", "--no-progress"]) == 1
    err_text = capsys.readouterr().err
    assert "error: could not download" in err_text and "Traceback" not in err_text
    for file in DATASETS["multi30k"].files:
        assert str(tmp_path / "m" / file.name) in err_text


def test_http_errors(server, tmp_path):
    spec = toy_spec({"missing.bin": b"x"})
    with pytest.raises(DownloadError, match="HTTP 404"):
        download(spec, tmp_path, base_url=server.url + "/toy", **FAST)
    data = random_bytes(3_000)
    base = serve(server, {"busy.bin": data})
    server.unavailable_once.add("/toy/busy.bin")  # a server error is worth another try
    download(toy_spec({"busy.bin": data}), tmp_path, base_url=base, **FAST)
    assert (tmp_path / "busy.bin").read_bytes() == data
    with pytest.raises(ValueError, match="unknown dataset 'iwslt'"):
        download("iwslt", tmp_path)


def tgz(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def wmt14_archives(rng):
    """Archives laid out like statmt.org's, each member with random aligned lines."""
    archives, texts = {}, {}
    for file in DATASETS["wmt14"].files:
        members, n = {}, int(rng.integers(2, 9))
        for member, local in file.extract:
            lines = [f"{local} line {i} {rng.integers(1 << 30)}" for i in range(n)]
            if local.endswith(".sgm"):
                body = "".join(f'<seg id="{i + 1}">{t}</seg>\n' for i, t in enumerate(lines))
                data = f'<refset>\n<doc docid="d" genre="news">\n{body}</doc>\n</refset>\n'
            else:
                data = "".join(t + "\n" for t in lines)
            members[member] = data.encode()
            texts[local] = lines
        members["other/unrelated.txt"] = b"not extracted\n"
        archives[file.path] = tgz(members)
    return archives, texts


def test_wmt14_archives_are_extracted_for_the_readers(server, tmp_path):
    archives, texts = wmt14_archives(np.random.default_rng())
    base = serve(server, archives, prefix="/statmt")
    # The real spec with its checksums swapped for trust on first use (fixture archives).
    spec = dataclasses.replace(DATASETS["wmt14"], files=tuple(
        dataclasses.replace(f, size=None, checksum=None) for f in DATASETS["wmt14"].files))
    download(spec, tmp_path, base_url=base, **FAST)
    assert missing_files("wmt14", tmp_path) == []
    assert not (tmp_path / "unrelated.txt").exists()
    train = load_wmt14(tmp_path, "train", "de", "en")
    assert train.src == (texts["europarl-v7.de-en.de"] + texts["commoncrawl.de-en.de"]
                         + texts["news-commentary-v9.de-en.de"])
    assert load_wmt14(tmp_path, "val").tgt == texts["newstest2013.de"]
    assert load_wmt14(tmp_path, "test").src == texts["newstest2014-deen-src.en.sgm"]
    # An extracted file that goes missing is extracted again, without a download.
    (tmp_path / "newstest2013.en").unlink()
    before = len(server.requests)
    download(spec, tmp_path, base_url=base, **FAST)
    assert len(server.requests) == before and missing_files("wmt14", tmp_path) == []

    # Offline: archives copied into DIR by hand are verified and extracted, no network used.
    by_hand = tmp_path / "by_hand"
    by_hand.mkdir()
    for path, data in archives.items():
        (by_hand / path.rsplit("/", 1)[-1]).write_bytes(data)
    download(spec, by_hand, base_url=closed_port_url(), **FAST)
    assert missing_files("wmt14", by_hand) == []

    # The real, pinned checksums reject these fixture archives.
    with pytest.raises(ChecksumError, match="training-parallel-commoncrawl.tgz"):
        download("wmt14", tmp_path / "pinned", base_url=base, **FAST)


def test_wmt14_archive_without_a_member_is_an_error(server, tmp_path):
    file = dataclasses.replace(DATASETS["wmt14"].files[3], size=None, checksum=None)
    spec = dataclasses.replace(DATASETS["wmt14"], files=(file,))
    base = serve(server, {file.path: tgz({"dev/newstest2013.en": b"only english\n"})})
    with pytest.raises(DownloadError, match="lacks the expected members: dev/newstest2013.de"):
        download(spec, tmp_path, base_url=base, **FAST)
    server.files["/toy/" + file.path] = random_bytes(5000)
    with pytest.raises(DownloadError, match="not a readable tar archive"):
        download(spec, tmp_path / "other", base_url=base, **FAST)


def test_multi30k_from_the_official_bytes(server, tmp_path, multi30k_dir, monkeypatch, capsys):
    """The real spec's pinned sha256 accept the shared copy of the official files."""
    base = serve(server, {f.name: (multi30k_dir / f.name).read_bytes()
                          for f in DATASETS["multi30k"].files}, prefix="/raw")
    monkeypatch.setenv("MINITRANSFORMER_MULTI30K_URL", base)
    assert main(["multi30k", "--dest", str(tmp_path), "--no-progress"]) == 0
    assert "multi30k is ready" in capsys.readouterr().out
    assert missing_files("multi30k", tmp_path) == []
    assert load_multi30k(tmp_path, "val").src == load_multi30k(multi30k_dir, "val").src
    manifest = json.loads((tmp_path / "MANIFEST.json").read_text())["files"]
    assert all("c9be912" in e["checked_against"] for e in manifest.values())
    # ensure_dataset finds everything in place and touches neither network nor files.
    before = len(server.requests)
    assert ensure_dataset("multi30k", tmp_path) == tmp_path
    assert len(server.requests) == before


def test_ensure_dataset_downloads_what_is_missing(server, tmp_path, multi30k_dir):
    base = serve(server, {f.name: (multi30k_dir / f.name).read_bytes()
                          for f in DATASETS["multi30k"].files}, prefix="/raw")
    ensure_dataset("multi30k", tmp_path / "new", base_url=base, **FAST)
    assert missing_files("multi30k", tmp_path / "new") == []


def test_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "multi30k" in out and "wmt14" in out and "--dest" in out and "--base-url" in out


def test_ensure_dataset_fetches_only_the_missing_files(server, tmp_path, multi30k_dir):
    """The files already there are the caller's: not re-checked, not moved aside."""
    base = serve(server, {f.name: (multi30k_dir / f.name).read_bytes()
                          for f in DATASETS["multi30k"].files}, prefix="/raw")
    for f in DATASETS["multi30k"].files:
        if f.name != "test_2016_flickr.de.gz":
            (tmp_path / f.name).write_bytes((multi30k_dir / f.name).read_bytes())
    # The same text compressed again: other bytes than the published file.
    mine = gzip.compress(gzip.decompress((multi30k_dir / "val.de.gz").read_bytes()), compresslevel=1)
    (tmp_path / "val.de.gz").write_bytes(mine)
    ensure_dataset("multi30k", tmp_path, base_url=base, **FAST)
    assert [p for p, _ in server.requests] == ["/raw/test_2016_flickr.de.gz"]
    assert (tmp_path / "val.de.gz").read_bytes() == mine and not list(tmp_path.glob("*.corrupt"))
    assert missing_files("multi30k", tmp_path) == []
