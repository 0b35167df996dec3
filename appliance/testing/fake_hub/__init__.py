"""A FAKE Hugging Face Hub: a test and demo instrument, never a real Hub or a mirror.

It serves folders as model repositories over plain HTTP on 127.0.0.1, speaking the part of the
Hub protocol that huggingface_hub 2.4 uses to download (reference/weights-and-hub.md §3): model
info (with files metadata), the Link-paginated tree, paths-info, HEAD/GET `resolve` with Range,
the Hub's ETag conventions (sha256 for LFS files, git blob ids for the rest), no Xet headers
(so clients stay on plain HTTP), optional bearer-token auth, a CDN-style cross-origin redirect,
and faults on demand. Every request is recorded (`requestlog.py`).

In-process::

    with FakeHub({"org/name": folder}, faults=["stall:*:1MiB:5"]) as hub:
        ...  # HF_ENDPOINT=hub.url; hub.requests(); hub.set_faults([...]); hub.commit("org/name")

As a process: `python -m appliance.testing.fake_hub --repo org/name=DIR --port 0` prints
`fake hub listening on http://127.0.0.1:PORT` once ready; SIGTERM or SIGINT stop it (exit 0).
At runtime: `POST /_fake/faults` (a JSON list of specs; replaces the set), `DELETE
/_fake/faults`, `GET /_fake/faults`, `GET` / `DELETE /_fake/requests`.

Fault specs (colon-separated). FILE is a repo-relative path, or `*` for any LFS file. Byte
counts take an optional K/KiB, M/MiB or G/GiB suffix (powers of 1024). A counted fault applies
to the first COUNT (default 1) matching GETs of a file body, then expires, so a client that
retries recovers; AFTER_BYTES counts bytes of that response's body (a body no longer than
that goes out whole, and the fault is spent all the same).

    stall:FILE:AFTER_BYTES[:SECONDS[:COUNT]]   send AFTER_BYTES, then nothing for SECONDS
                                                (default 3600: until the client gives up),
                                                then close
    close:FILE:AFTER_BYTES[:COUNT]              send AFTER_BYTES, then close cleanly although
                                                Content-Length promised more (a short body)
    reset:FILE:AFTER_BYTES[:COUNT]              send AFTER_BYTES, then a TCP reset
    corrupt:FILE[:COUNT]                        same size, two bytes flipped (at size//2 and
                                                at the last byte: tensor data, not the header)
    trickle:FILE:BYTES_PER_SEC[:AFTER_BYTES[:COUNT]]
                                                after AFTER_BYTES (default 0) at full speed,
                                                dribble at BYTES_PER_SEC, a write every 0.5 s
    5xx:COUNT[:STATUS[:RETRY_AFTER]]            the next COUNT GETs of `/resolve/` or
                                                `/lfs-blobs/` answer STATUS (default 503),
                                                with `Retry-After` if given
    429:COUNT[:RETRY_AFTER]                     the same with 429
    redirect                                    LFS files answer `/resolve/` with a 302 to
                                                `/lfs-blobs/...` on another origin (a CDN),
                                                which needs no token
    rate:BYTES_PER_SEC                          every body at most this fast, per connection
    hang-api                                    `/api/...` never answers
    no-range                                    ignore Range: always 200 with the whole body

`redirect`, `rate`, `hang-api` and `no-range` stay on until cleared. A bad spec raises
`FaultSpecError` (a ValueError naming the spec and the expected form); the CLI exits 2.
"""

from appliance.testing.fake_hub.faults import FORMS as FAULT_FORMS
from appliance.testing.fake_hub.faults import FaultSpecError, parse_fault
from appliance.testing.fake_hub.hub import FakeHub

__all__ = ["FAULT_FORMS", "FakeHub", "FaultSpecError", "parse_fault"]
