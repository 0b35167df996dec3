"""The fake Hugging Face Hub (`appliance.testing.fake_hub`) over real HTTP on 127.0.0.1: the
protocol as huggingface_hub 2.4 reads it (proved with the real client in a subprocess), Range,
auth, the CDN redirect, every fault, the request log and the CLI.

Every wait is bounded and polls something observable; the only timing assertions are one-sided
bounds a slow machine cannot break (a throttled body cannot arrive faster than its rate).
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from appliance.testing import fake_hub
from appliance.testing.checkpoint import write_checkpoint
from appliance.testing.fake_hub import FakeHub, FaultSpecError, parse_fault
from appliance.testing.fake_hub.body import ByteRange, RangeNotSatisfiable, parse_range
from appliance.testing.fake_hub.faults import Cut, StatusFault, Trickle
from tests.conftest import REPO, wait_for

REPO_ID = "org/name"
SHARD = "model-00002-of-00003.safetensors"
SHARD_BYTES = 256 * 1024
TIMEOUT = httpx.Timeout(10.0)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("hub") / "repo"
    write_checkpoint(folder, shards=3, shard_bytes=SHARD_BYTES)
    return folder


@pytest.fixture
def hub(repo: Path) -> Iterator[FakeHub]:
    with FakeHub({REPO_ID: repo}) as running:
        yield running


@pytest.fixture
def client(hub: FakeHub) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=hub.url, timeout=TIMEOUT) as http:
        yield http


def files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def git_oid(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content, usedforsecurity=False).hexdigest()


def sha256(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()


def resolve(path: str, revision: str = "main") -> str:
    return f"/{REPO_ID}/resolve/{revision}/{path}"


def stream_until_error(http: httpx.Client, url: str, **kwargs: Any,
                       ) -> tuple[bytes, Exception | None]:
    """GET `url` as a stream; the bytes that arrived and the error that ended it, if any."""
    received = bytearray()
    try:
        with http.stream("GET", url, **kwargs) as response:
            for chunk in response.iter_raw():
                received += chunk
    except httpx.TransportError as exc:
        return bytes(received), exc
    return bytes(received), None


def record(hub: FakeHub, method: str, path_end: str) -> dict[str, Any]:
    """The last request record whose path ends with `path_end`, once it is done (waits)."""

    def finished() -> dict[str, Any] | None:
        last = next((r for r in reversed(hub.requests())
                     if r["method"] == method and r["path"].endswith(path_end)), None)
        return last if last is not None and last["done"] else None

    return wait_for(finished, f"a finished record of {method} ...{path_end}", timeout=15)


def settled(hub: FakeHub) -> list[dict[str, Any]]:
    """The request log once every request in it is done (a client may exit before the server
    thread that answered it has recorded the end)."""
    return wait_for(lambda: (log := hub.requests()) and all(r["done"] for r in log) and log,
                    "every request to finish", timeout=15)


def log_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON-lines request log in arrival order (lines are written as requests end)."""
    return sorted((json.loads(line) for line in path.read_text().splitlines()),
                  key=lambda r: r["t"])


# -- pure parts ---------------------------------------------------------------------------


def test_parse_range() -> None:
    assert parse_range(None, 100) is None
    assert parse_range("bytes=10-", 100) == ByteRange(10, 99)
    assert ByteRange(10, 99).length == 90
    assert parse_range("bytes=10-19", 100) == ByteRange(10, 19)
    assert parse_range("bytes=90-500", 100) == ByteRange(90, 99)
    assert parse_range("bytes=-10", 100) == ByteRange(90, 99)
    assert parse_range("bytes=-500", 100) == ByteRange(0, 99)
    for ignored in ("bytes=5-1", "bytes=0-1,5-6", "items=0-1", "bytes=-", "garbage"):
        assert parse_range(ignored, 100) is None
    assert parse_range("bytes=0-", 0) is None
    for unsatisfiable in ("bytes=100-", "bytes=100-200", "bytes=-0"):
        with pytest.raises(RangeNotSatisfiable):
            parse_range(unsatisfiable, 100)


def test_parse_fault_specs() -> None:
    assert parse_fault("stall:*:1MiB") == Cut("stall:*:1MiB", "stall", "*", 1 << 20, 3600.0, 1)
    assert parse_fault(f"trickle:{SHARD}:1000:64k:2") == \
        Trickle(f"trickle:{SHARD}:1000:64k:2", SHARD, 1000.0, 65536, 2)
    assert parse_fault("5xx:3:502:7") == StatusFault("5xx:3:502:7", 502, "7", 3)
    assert parse_fault("429:1") == StatusFault("429:1", 429, None, 1)
    bad = {
        "stall:x": "stall:FILE:AFTER_BYTES[:SECONDS[:COUNT]]",
        "close:f:lots": "close:FILE:AFTER_BYTES[:COUNT]",
        "corrupt:f:0": "corrupt:FILE[:COUNT]",
        "trickle:f:0": "trickle:FILE:BYTES_PER_SEC",
        "5xx:1:404": "5xx:COUNT[:STATUS[:RETRY_AFTER]]",
        "429:1:soon": "429:COUNT[:RETRY_AFTER]",
        "rate": "rate:BYTES_PER_SEC",
        "redirect:now": "redirect",
        "explode:f": "unknown fault spec",
    }
    for spec, expected in bad.items():
        with pytest.raises(FaultSpecError) as caught:
            parse_fault(spec)
        assert repr(spec) in str(caught.value) and expected in str(caught.value)
    assert isinstance(FaultSpecError("x"), ValueError)
    with pytest.raises(ValueError, match="stall:FILE:AFTER_BYTES"):
        FakeHub({REPO_ID: REPO}, faults=["redirect", "stall:x"])


# -- the protocol -------------------------------------------------------------------------


def test_model_info_with_files_metadata(hub: FakeHub, client: httpx.Client, repo: Path) -> None:
    content = files(repo)
    response = client.get(f"/api/models/{REPO_ID}", params={"blobs": "True"})
    assert response.status_code == 200
    info = response.json()
    assert info["id"] == info["modelId"] == REPO_ID
    assert info["sha"] == hub.commit(REPO_ID) and len(info["sha"]) == 40
    siblings = {s["rfilename"]: s for s in info["siblings"]}
    assert set(siblings) == set(content)
    for path, data in content.items():
        sibling = siblings[path]
        assert sibling["size"] == len(data)
        if path.endswith(".safetensors"):
            assert sibling["lfs"]["sha256"] == sha256(data)
            assert sibling["lfs"]["size"] == len(data)
            assert sibling["lfs"]["pointerSize"] > 100
        else:
            assert "lfs" not in sibling
            assert sibling["blobId"] == git_oid(data)
        assert len(sibling["blobId"]) == 40
    assert siblings["config.json"]["blobId"] == git_oid((repo / "config.json").read_bytes())

    plain = client.get(f"/api/models/{REPO_ID}/revision/{info['sha']}").json()
    assert plain["sha"] == info["sha"]
    assert all(set(s) == {"rfilename"} for s in plain["siblings"])
    assert client.get(f"/api/models/{REPO_ID}/revision/main?blobs=1").json()["siblings"] \
        == info["siblings"]

    missing_rev = client.get(f"/api/models/{REPO_ID}/revision/v2")
    assert (missing_rev.status_code, missing_rev.headers["x-error-code"]) == \
        (404, "RevisionNotFound")
    missing_repo = client.get("/api/models/org/nope")
    assert (missing_repo.status_code, missing_repo.headers["x-error-code"]) == \
        (404, "RepoNotFound")
    assert "error" in missing_repo.json()

    # The commit is a function of the content: a restarted hub agrees.
    with FakeHub({REPO_ID: repo}) as again:
        assert again.commit(REPO_ID) == info["sha"]


def test_tree_pagination_and_paths_info(repo: Path) -> None:
    content = files(repo)
    with FakeHub({REPO_ID: repo}, page_size=2) as hub, \
            httpx.Client(timeout=TIMEOUT) as http:
        commit = hub.commit(REPO_ID)
        url: str | None = \
            f"{hub.url}/api/models/{REPO_ID}/tree/{commit}?recursive=true&expand=false"
        seen: list[dict[str, Any]] = []
        pages = 0
        while url:
            response = http.get(url)
            assert response.status_code == 200
            page = response.json()
            assert len(page) <= 2
            seen += page
            pages += 1
            url = response.links.get("next", {}).get("url")
        assert pages == -(-len(content) // 2)
        assert sorted(item["path"] for item in seen) == sorted(content)  # each exactly once
        for item in seen:
            data = content[item["path"]]
            assert (item["type"], item["size"]) == ("file", len(data))
            if item["path"].endswith(".safetensors"):
                assert item["lfs"] == {"oid": sha256(data), "size": len(data),
                                       "pointerSize": item["lfs"]["pointerSize"]}
            else:
                assert item["oid"] == git_oid(data) and "lfs" not in item

        info = http.post(f"{hub.url}/api/models/{REPO_ID}/paths-info/main",
                         data={"paths": ["config.json", SHARD, "no-such-file"],
                               "expand": "False"})
        assert info.status_code == 200
        by_path = {item["path"]: item for item in info.json()}
        assert set(by_path) == {"config.json", SHARD}
        assert by_path[SHARD]["lfs"]["oid"] == sha256(content[SHARD])
        assert by_path["config.json"]["oid"] == git_oid(content["config.json"])


def test_nested_paths_and_changing_content(tmp_path: Path) -> None:
    (tmp_path / "sub" / "deeper").mkdir(parents=True)
    (tmp_path / "README.md").write_text("hello\n")
    (tmp_path / "sub" / "deeper" / "a b.json").write_text('{"x": 1}\n')
    (tmp_path / ".cache" / "huggingface").mkdir(parents=True)  # a local_dir's bookkeeping
    (tmp_path / ".cache" / "huggingface" / "x.metadata").write_text("ignored\n")
    with FakeHub({REPO_ID: tmp_path}) as hub, \
            httpx.Client(base_url=hub.url, timeout=TIMEOUT) as http:
        top = http.get(f"/api/models/{REPO_ID}/tree/main").json()
        assert {(i["type"], i["path"]) for i in top} == {("file", "README.md"),
                                                         ("directory", "sub")}
        sub = http.get(f"/api/models/{REPO_ID}/tree/main/sub?recursive=true").json()
        assert [i["path"] for i in sub] == ["sub/deeper/a b.json"]
        assert http.get(f"/api/models/{REPO_ID}/tree/main/nope").headers["x-error-code"] \
            == "EntryNotFound"
        got = http.get(resolve("sub/deeper/a%20b.json"))
        assert got.status_code == 200 and got.content == b'{"x": 1}\n'
        before = hub.commit(REPO_ID)
        (tmp_path / "README.md").write_text("hello again\n")
        assert hub.commit(REPO_ID) != before


def test_resolve_get_head_and_ranges(hub: FakeHub, client: httpx.Client, repo: Path) -> None:
    data = (repo / SHARD).read_bytes()
    size = len(data)
    commit = hub.commit(REPO_ID)

    head = client.head(resolve(SHARD), headers={"Accept-Encoding": "gzip"})
    assert head.status_code == 200
    assert head.headers["x-repo-commit"] == commit
    assert head.headers["x-linked-etag"] == f'"{sha256(data)}"'
    assert head.headers["etag"] == f'"{sha256(data)}"'
    assert head.headers["x-linked-size"] == head.headers["content-length"] == str(size)
    assert head.headers["accept-ranges"] == "bytes"
    assert head.headers["content-type"] == "application/octet-stream"
    assert "content-encoding" not in head.headers

    config = (repo / "config.json").read_bytes()
    small = client.head(resolve("config.json", commit))
    assert small.headers["etag"] == f'"{git_oid(config)}"'
    assert "x-linked-etag" not in small.headers

    full = client.get(resolve(SHARD), headers={"Accept-Encoding": "gzip"})
    assert (full.status_code, full.content) == (200, data)
    assert "content-encoding" not in full.headers
    for header, first, last in (("bytes=1000-", 1000, size - 1), ("bytes=10-19", 10, 19),
                                ("bytes=-100", size - 100, size - 1)):
        part = client.get(resolve(SHARD), headers={"Range": header})
        assert part.status_code == 206, header
        assert part.headers["content-range"] == f"bytes {first}-{last}/{size}"
        assert part.content == data[first:last + 1]
        assert part.headers["content-length"] == str(last - first + 1)
    beyond = client.get(resolve(SHARD), headers={"Range": f"bytes={size}-"})
    assert beyond.status_code == 416
    assert beyond.headers["content-range"] == f"bytes */{size}"

    missing = client.head(resolve("nope.bin"))
    assert (missing.status_code, missing.headers["x-error-code"]) == (404, "EntryNotFound")
    assert missing.headers["x-repo-commit"] == commit
    assert client.get(resolve("config.json", "v9")).headers["x-error-code"] == \
        "RevisionNotFound"
    assert client.get("/org/nope/resolve/main/config.json").headers["x-error-code"] == \
        "RepoNotFound"

    ranged = record(hub, "GET", SHARD)
    assert ranged["status"] == 416 and ranged["range"] == f"bytes={size}-"
    served = [r for r in hub.requests() if r["status"] == 200 and r["method"] == "GET"]
    assert served[0]["bytes"] == size and served[0]["auth"] is False
    assert served[0]["host"] == hub.url.removeprefix("http://")


def test_token(repo: Path, tmp_path: Path) -> None:
    log = tmp_path / "requests.jsonl"
    with FakeHub({REPO_ID: repo}, token="sekret", faults=["redirect"], request_log=log) as hub, \
            httpx.Client(base_url=hub.url, timeout=TIMEOUT) as http:
        denied = http.get(f"/api/models/{REPO_ID}")
        assert denied.status_code == 401 and denied.headers["x-error-code"] == "GatedRepo"
        assert "error" in denied.json()
        assert http.head(resolve("config.json")).status_code == 401
        wrong = http.get(f"/api/models/{REPO_ID}", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        bearer = {"Authorization": "Bearer sekret"}
        assert http.get(f"/api/models/{REPO_ID}", headers=bearer).status_code == 200
        moved = http.get(resolve(SHARD), headers=bearer)
        assert moved.status_code == 302
        location = moved.headers["location"]
        assert location.startswith(hub.cdn_url) and hub.cdn_url != hub.url
        assert httpx.get(location, timeout=TIMEOUT).content == (repo / SHARD).read_bytes()
        assert http.get("/_fake/faults").status_code == 200  # control needs no token
    lines = log_lines(log)
    assert [r["status"] for r in lines] == [401, 401, 401, 200, 302, 200, 200]
    assert [r["auth"] for r in lines] == [False, False, True, True, True, False, False]


# -- the real client ----------------------------------------------------------------------

CLIENT_SCRIPT = """
import json, sys
from huggingface_hub import HfApi, snapshot_download
repo, local_dir, token = sys.argv[1], sys.argv[2], sys.argv[3] or False
info = HfApi().model_info(repo, files_metadata=True, token=token, timeout=30)
path = snapshot_download(repo, local_dir=local_dir, token=token)
print(json.dumps({"sha": info.sha, "path": path, "siblings": {
    s.rfilename: [s.size, s.blob_id, s.lfs.sha256 if s.lfs else None] for s in info.siblings}}))
"""


def run_hf_client(hub: FakeHub, tmp_path: Path, token: str = "") -> dict[str, Any]:
    """snapshot_download + model_info in a subprocess: huggingface_hub reads HF_* at import."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=hub.url, HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1",
               HF_HUB_DISABLE_PROGRESS_BARS="1", HF_HOME=str(tmp_path / "hf-home"),
               HF_HUB_DOWNLOAD_TIMEOUT="10")
    done = subprocess.run([sys.executable, "-c", CLIENT_SCRIPT, REPO_ID,
                           str(tmp_path / "out"), token],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    result["stderr"] = done.stderr
    return result


def test_huggingface_hub_downloads_a_snapshot(hub: FakeHub, repo: Path, tmp_path: Path) -> None:
    result = run_hf_client(hub, tmp_path)
    content = files(repo)
    assert result["sha"] == hub.commit(REPO_ID)
    downloaded = files(Path(result["path"]))
    assert {p: d for p, d in downloaded.items() if not p.startswith(".cache/")} == content
    for path, (size, blob_id, lfs_sha256) in result["siblings"].items():
        assert size == len(content[path])
        if path.endswith(".safetensors"):
            assert lfs_sha256 == sha256(content[path])
        else:
            assert blob_id == git_oid(content[path]) and lfs_sha256 is None
    requests = settled(hub)
    assert f"/api/models/{REPO_ID}/tree/{result['sha']}" in [r["path"] for r in requests]
    assert all(r["status"] in (200, 206) for r in requests)


def test_huggingface_hub_across_the_cdn_redirect_with_a_token(repo: Path, tmp_path: Path) -> None:
    # A short body on one shard too: the client retries it (from byte 0 here: it resumes only
    # at multiples of its 10 MiB read chunk, and these shards are smaller).
    faults = ["redirect", f"close:{SHARD}:100000"]
    with FakeHub({REPO_ID: repo}, token="T0K", faults=faults) as hub:
        result = run_hf_client(hub, tmp_path, token="T0K")
        requests = settled(hub)
    downloaded = files(Path(result["path"]))
    assert {p: d for p, d in downloaded.items() if not p.startswith(".cache/")} == files(repo)
    blobs = [r for r in requests if r["path"].startswith("/lfs-blobs/")]
    assert len(blobs) == 4  # three shards, one of them twice
    assert all(not r["auth"] and r["host"].startswith("localhost:") for r in blobs)
    assert sorted(r["bytes"] for r in blobs)[0] == 100000
    others = [r for r in requests if not r["path"].startswith("/lfs-blobs/")]
    assert others and all(r["auth"] for r in others)
    assert {r["status"] for r in others if "/resolve/" in r["path"] and
            r["path"].endswith(".safetensors")} == {302}


# -- faults -------------------------------------------------------------------------------


def test_stall_then_clean(hub: FakeHub, repo: Path) -> None:
    hub.set_faults([f"stall:{SHARD}:65536"])
    with httpx.Client(base_url=hub.url, timeout=httpx.Timeout(10.0, read=1.0)) as http:
        received, error = stream_until_error(http, resolve(SHARD))
        assert isinstance(error, httpx.ReadTimeout)
        assert received == (repo / SHARD).read_bytes()[:65536]
        # The server notices the client left (not an hour later) and records what it sent.
        stalled = record(hub, "GET", SHARD)
        assert (stalled["status"], stalled["bytes"]) == (200, 65536)
        assert hub.faults() == []
        assert http.get(resolve(SHARD)).content == (repo / SHARD).read_bytes()


def test_close_and_reset(hub: FakeHub, client: httpx.Client, repo: Path) -> None:
    data = (repo / SHARD).read_bytes()
    hub.set_faults([f"close:{SHARD}:1000", "reset:*:2000"])
    received, error = stream_until_error(client, resolve(SHARD))
    assert isinstance(error, httpx.RemoteProtocolError)  # what huggingface_hub retries
    assert received == data[:1000]
    # The close fault is spent; the reset one matches any LFS file.
    received, error = stream_until_error(client, resolve(SHARD))
    assert isinstance(error, httpx.TransportError) and len(received) <= 2000
    assert data.startswith(received)
    assert record(hub, "GET", SHARD)["bytes"] == 2000
    assert client.get(resolve(SHARD)).content == data


def test_corrupt(hub: FakeHub, client: httpx.Client, repo: Path) -> None:
    data = (repo / SHARD).read_bytes()
    hub.set_faults([f"corrupt:{SHARD}"])
    bad = client.get(resolve(SHARD))
    assert bad.status_code == 200 and len(bad.content) == len(data)
    assert sha256(bad.content) != sha256(data)
    assert bad.content[:8] == data[:8]  # the safetensors header length survives
    assert client.get(resolve(SHARD)).content == data


def test_trickle_and_rate(hub: FakeHub, repo: Path) -> None:
    hub.set_faults([f"trickle:{SHARD}:4000:100000"])
    received = bytearray()
    with httpx.Client(base_url=hub.url, timeout=TIMEOUT) as http, \
            http.stream("GET", resolve(SHARD)) as response:
        started = time.monotonic()
        for chunk in response.iter_raw():
            received += chunk
            if len(received) > 100000 and time.monotonic() - started > 1.5:
                break
        elapsed = time.monotonic() - started
    assert 100000 < len(received) < SHARD_BYTES
    assert len(received) <= 100000 + 4000 * (elapsed + 1)  # cannot outrun its rate
    assert bytes(received) == (repo / SHARD).read_bytes()[:len(received)]

    hub.set_faults(["rate:200KiB"])
    with httpx.Client(base_url=hub.url, timeout=TIMEOUT) as http:
        started = time.monotonic()
        body = http.get(resolve(SHARD)).content
        assert time.monotonic() - started >= 0.5  # 256 KiB at 200 KiB/s: about 1.3 s
    assert body == (repo / SHARD).read_bytes()
    assert hub.faults() == [{"spec": "rate:200KiB", "remaining": None}]


def test_status_faults(hub: FakeHub, client: httpx.Client, repo: Path) -> None:
    hub.set_faults(["5xx:2:503:1"])
    assert client.head(resolve(SHARD)).status_code == 200  # HEADs do not consume them
    for _ in range(2):
        failed = client.get(resolve(SHARD))
        assert failed.status_code == 503 and failed.headers["retry-after"] == "1"
    assert client.get(resolve(SHARD)).content == (repo / SHARD).read_bytes()
    hub.set_faults(["429:1:2", "5xx:1:500"])
    limited = client.get(resolve("config.json"))
    assert limited.status_code == 429 and limited.headers["retry-after"] == "2"
    plain = client.get(resolve("config.json"))
    assert plain.status_code == 500 and "retry-after" not in plain.headers
    assert client.get(resolve("config.json")).status_code == 200


def test_no_range(hub: FakeHub, client: httpx.Client, repo: Path) -> None:
    hub.set_faults(["no-range"])
    ignored = client.get(resolve(SHARD), headers={"Range": "bytes=100-"})
    assert ignored.status_code == 200 and ignored.content == (repo / SHARD).read_bytes()
    assert "content-range" not in ignored.headers


def test_hang_api(hub: FakeHub, client: httpx.Client) -> None:
    hub.set_faults(["hang-api"])
    with pytest.raises(httpx.ReadTimeout):
        client.get(f"/api/models/{REPO_ID}", timeout=httpx.Timeout(10.0, read=1.0))
    assert client.head(resolve("config.json")).status_code == 200  # files still flow
    hung = record(hub, "GET", f"/api/models/{REPO_ID}")
    assert hung["status"] is None and hung["bytes"] == 0


def test_runtime_fault_control(hub: FakeHub, client: httpx.Client) -> None:
    assert client.get("/_fake/faults").json() == []
    posted = client.post("/_fake/faults", json=["corrupt:config.json:2", "redirect"])
    assert posted.json() == [{"spec": "corrupt:config.json:2", "remaining": 2},
                             {"spec": "redirect", "remaining": None}]
    client.get(resolve("config.json"))
    assert hub.faults()[0]["remaining"] == 1
    refused = client.post("/_fake/faults", json=["stall:x"])
    assert refused.status_code == 400 and "stall:FILE:AFTER_BYTES" in refused.json()["error"]
    assert len(hub.faults()) == 2  # a bad set changes nothing
    assert client.post("/_fake/faults", content=b"{not json").status_code == 400
    assert client.delete("/_fake/faults").json() == []
    records = client.get("/_fake/requests").json()
    assert [r["path"] for r in records][:2] == ["/_fake/faults", "/_fake/faults"]
    assert client.delete("/_fake/requests").status_code == 200
    assert [r["path"] for r in client.get("/_fake/requests").json()] == ["/_fake/requests"]


def test_stop_does_not_wait_for_stalled_clients(repo: Path) -> None:
    hub = FakeHub({REPO_ID: repo}, faults=["stall:*:1000", "hang-api"]).start()
    outcomes: list[object] = []

    def fetch(url: str) -> None:
        with httpx.Client(timeout=httpx.Timeout(60.0)) as http:
            outcomes.append(stream_until_error(http, url)[1])

    threads = [threading.Thread(target=fetch, args=(hub.url + u,), daemon=True)
               for u in (resolve(SHARD), f"/api/models/{REPO_ID}")]
    for thread in threads:
        thread.start()
    wait_for(lambda: hub.faults() == [{"spec": "hang-api", "remaining": None}],
             "the stall to be taken")
    time.sleep(0.2)  # let the hang-api request arrive too; nothing is asserted on it
    started = time.monotonic()
    hub.stop()
    assert time.monotonic() - started < 10  # an hour-long stall, ended by stop()
    for thread in threads:
        thread.join(timeout=10)
    assert len(outcomes) == 2 and all(isinstance(o, httpx.TransportError) for o in outcomes)


def test_cdn_on_a_second_port_when_localhost_does_not_reach(
        repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fake_hub.hub, "localhost_reaches", lambda host: False)
    with FakeHub({REPO_ID: repo}, faults=["redirect"]) as hub, \
            httpx.Client(base_url=hub.url, timeout=TIMEOUT, follow_redirects=True) as http:
        assert hub.cdn_url.startswith("http://127.0.0.1:") and hub.cdn_url != hub.url
        got = http.get(resolve(SHARD))
        assert got.content == (repo / SHARD).read_bytes()
        assert str(got.url).startswith(hub.cdn_url + "/lfs-blobs/")


# -- the CLI ------------------------------------------------------------------------------


def test_cli(repo: Path, tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    command = [sys.executable, "-m", "appliance.testing.fake_hub", "--repo",
               f"{REPO_ID}={repo}", "--port", "0", "--request-log", str(log),
               "--fault", "corrupt:config.json"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          cwd=REPO) as process:
        try:
            assert process.stdout is not None
            ready, _, _ = select.select([process.stdout], [], [], 30)
            assert ready, "no listening line within 30 s"
            line = process.stdout.readline()
            assert line.startswith("fake hub listening on http://127.0.0.1:"), line
            url = line.split()[-1]
            with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
                assert http.get(resolve("config.json")).content != \
                    (repo / "config.json").read_bytes()
                assert http.get(resolve(SHARD)).content == (repo / SHARD).read_bytes()
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=15) == 0
        finally:
            if process.poll() is None:
                process.kill()
    lines = log_lines(log)
    assert [(r["method"], r["status"]) for r in lines] == [("GET", 200), ("GET", 200)]
    assert lines[1]["bytes"] == len((repo / SHARD).read_bytes())

    for argv, message in ((["--fault", "stall:x"], "stall:FILE:AFTER_BYTES"),
                          (["--fault", "bogus"], "unknown fault spec 'bogus'"),
                          (["--repo", "noslash=" + str(repo)], "ORG/NAME"),
                          (["--repo", f"a/b={tmp_path / 'missing'}"], "not a directory")):
        base = ["--repo", f"{REPO_ID}={repo}"] if argv[0] == "--fault" else []
        done = subprocess.run([sys.executable, "-m", "appliance.testing.fake_hub", *base,
                               *argv], capture_output=True, text=True, timeout=30, cwd=REPO)
        assert done.returncode == 2, done
        assert message in done.stderr and done.stdout == ""


def test_copy_of_a_downloaded_dir_serves_the_same_commit(repo: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(repo, copy)
    (copy / ".cache" / "huggingface").mkdir(parents=True)
    (copy / ".cache" / "huggingface" / "config.json.metadata").write_text("x\n")
    with FakeHub({REPO_ID: repo, "org/copy": copy}) as hub:
        assert hub.commit("org/copy") == hub.commit(REPO_ID)
