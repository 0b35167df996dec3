"""The quick verification tier: is the model directory whole, from sizes and headers alone?

Run on every start and before every engine load (a 90-minute investment), it proves in well
under a second for 96 shards what can be proven without reading 1.56 TB: every file the
manifest lists is a regular file inside the model directory with exactly its size; every
shard's safetensors header is sound (safetensors.py); the index and the shards agree tensor
for tensor; config.json parses. It cannot see flipped bytes inside tensor data: that is the
full tier (hashing.py).

Blocking (a few hundred small reads); callers run it in a thread. Problems come back as
values naming the file and the next step; nothing here raises for a bad directory.
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from appliance.weights.manifest import PART_SUFFIX, Manifest
from appliance.weights.safetensors import ShardHeader, check_shard

INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
EXAMPLES = 3  # tensor names quoted per coverage problem; a shard can hold thousands
REFETCH = "fetch it again with `appliance weights refetch` or re-copy it"


@dataclass(frozen=True)
class FileProblem:
    """One thing wrong with one file; `message` names the file and, where useful, what to do."""

    path: str
    message: str


@dataclass(frozen=True)
class QuickReport:
    """The quick tier's verdict. `ok` is exactly "no problems"; warnings never fail it."""

    ok: bool
    problems: tuple[FileProblem, ...]
    warnings: tuple[FileProblem, ...]
    files_checked: int
    shards_checked: int
    elapsed_seconds: float


def quick_verify(model_dir: Path, manifest: Manifest) -> QuickReport:
    """Check `model_dir` against `manifest`: presence, exact sizes, containment, safetensors
    structure of every shard, index coverage and config.json."""
    started = time.monotonic()
    problems: list[FileProblem] = []
    warnings: list[FileProblem] = []
    root = _root(model_dir, problems)
    headers: dict[str, ShardHeader] = {}
    present: set[str] = set()
    if root is not None:
        for item in manifest.files:
            located = _locate(root, item.path, problems)
            if located is None:
                continue
            present.add(item.path)
            path, size = located
            if size != item.size:
                problems.append(FileProblem(item.path, _size_message(item.path, size, item.size)))
            if os.path.lexists(root / f"{item.path}{PART_SUFFIX}"):
                warnings.append(FileProblem(item.path, (
                    f"{item.path}{PART_SUFFIX} is left over from an unfinished download; "
                    "it is not used and can be deleted")))
            if item.is_shard:
                headers[item.path] = header = check_shard(path)
                problems.extend(_shard_problems(item.path, header))
        if INDEX in present:
            _check_index(root, headers, {f.path for f in manifest.shards}, "the manifest",
                         problems, warnings)
        if CONFIG in present:
            _check_config(root, problems)
    return QuickReport(ok=not problems, problems=_by_file(problems),
                       warnings=_by_file(warnings), files_checked=len(present),
                       shards_checked=len(headers),
                       elapsed_seconds=time.monotonic() - started)


def quick_verify_dir(model_dir: Path) -> QuickReport:
    """Structure only, for a directory with no manifest (an import before reference hashes
    exist): every `*.safetensors` file, index coverage against the shards present, and a
    config.json that parses. Sizes cannot be checked, so a truncation is found only where
    the header shows it."""
    started = time.monotonic()
    problems: list[FileProblem] = []
    warnings: list[FileProblem] = []
    root = _root(model_dir, problems)
    headers: dict[str, ShardHeader] = {}
    checked = 0
    if root is not None:
        for path in sorted(root.rglob("*.safetensors")):
            name = path.relative_to(root).as_posix()
            if _locate(root, name, problems) is not None:
                headers[name] = header = check_shard(path)
                problems.extend(_shard_problems(name, header))
        if not headers:
            problems.append(FileProblem("", f"{model_dir} holds no *.safetensors files; "
                                            "point the import at the model's folder"))
        checked = len(headers)
        has_index = os.path.lexists(root / INDEX)
        if has_index and _locate(root, INDEX, problems) is not None:
            checked += 1
            _check_index(root, headers, set(headers), "the model directory", problems,
                         warnings)
        elif not has_index and len(headers) > 1:
            problems.append(FileProblem(INDEX, (
                f"{INDEX} is missing, so the engine cannot tell which of the "
                f"{len(headers)} shards holds which tensor; copy it from the model's source")))
        if _locate(root, CONFIG, problems) is not None:
            checked += 1
            _check_config(root, problems)
    return QuickReport(ok=not problems, problems=_by_file(problems),
                       warnings=_by_file(warnings), files_checked=checked,
                       shards_checked=len(headers),
                       elapsed_seconds=time.monotonic() - started)


def _by_file(problems: list[FileProblem]) -> tuple[FileProblem, ...]:
    # Stable: a file's own sentences keep their order (size, then structure, then coverage).
    return tuple(sorted(problems, key=lambda p: p.path))


def _root(model_dir: Path, problems: list[FileProblem]) -> Path | None:
    try:
        root = model_dir.resolve(strict=True)
    except (OSError, RuntimeError):
        root = None
    if root is None or not root.is_dir():
        problems.append(FileProblem("", f"the model directory {model_dir} does not exist or "
                                        "is not a directory; check paths.models_dir and that "
                                        "its volume is mounted"))
        return None
    return root


def _locate(root: Path, name: str, problems: list[FileProblem]) -> tuple[Path, int] | None:
    """The real path and size of `root/name` when it is a regular file inside `root`; else
    None, with the problem appended. Symlinks are followed but must not leave the directory:
    the engine would read whatever they point at, which no manifest vouches for."""
    path = root / name
    try:
        real = path.resolve(strict=True)
        st = real.stat()
    except FileNotFoundError:
        if path.is_symlink():
            problems.append(FileProblem(name, f"{name} is a symlink to something that does "
                                              f"not exist ({os.readlink(path)}); {REFETCH}"))
        else:
            problems.append(FileProblem(name, f"{name} is missing; fetch it with `appliance "
                                              "weights pull` or copy it into the model "
                                              "directory"))
        return None
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop (Python 3.11)
        reason = exc.strerror if isinstance(exc, OSError) else str(exc)
        problems.append(FileProblem(name, f"{name} cannot be read ({reason}); check its "
                                          "permissions, its symlinks and the disk"))
        return None
    if not real.is_relative_to(root):
        problems.append(FileProblem(name, f"{name} is a symlink to {real}, outside the model "
                                          "directory; replace it with the file itself"))
        return None
    if not stat.S_ISREG(st.st_mode):
        problems.append(FileProblem(name, f"{name} is not a regular file; replace it with "
                                          "the file itself"))
        return None
    return real, st.st_size


def _size_message(name: str, size: int, expected: int) -> str:
    if size < expected:
        diff = expected - size
        return (f"{name} is {diff} byte{'s' * (diff != 1)} shorter than the manifest says "
                f"({expected}): it was truncated or replaced; {REFETCH}")
    diff = size - expected
    return (f"{name} is {diff} byte{'s' * (diff != 1)} longer than the manifest says "
            f"({expected}): it is not the file the manifest describes; {REFETCH}")


def _shard_problems(name: str, header: ShardHeader) -> Iterable[FileProblem]:
    for index, problem in enumerate(header.problems):
        # The hint once per shard: a damaged shard can have several sentences.
        hint = f"; {REFETCH}" if index == len(header.problems) - 1 else ""
        yield FileProblem(name, f"{name}: {problem}{hint}")


def _check_index(root: Path, headers: Mapping[str, ShardHeader], shard_paths: Collection[str],
                 listed_by: str, problems: list[FileProblem],
                 warnings: list[FileProblem]) -> None:
    """Index against shards: the shards it names are exactly `shard_paths`; each tensor it
    maps to a shard is in that shard's header and each tensor in a header is mapped there.
    Shards whose headers are already bad are skipped: their own problems say enough."""
    try:
        body = json.loads((root / INDEX).read_bytes())
    except (OSError, ValueError) as exc:
        problems.append(FileProblem(INDEX, f"{INDEX} cannot be read as JSON ({exc}); "
                                           f"{REFETCH}"))
        return
    weight_map = body.get("weight_map") if isinstance(body, dict) else None
    malformed = FileProblem(INDEX, f"{INDEX} has no weight_map of tensor names to shard "
                                   f"files; {REFETCH}")
    if not isinstance(weight_map, dict):
        problems.append(malformed)
        return
    mapped: dict[str, set[str]] = {}
    for tensor, shard in weight_map.items():
        if type(shard) is not str:
            problems.append(malformed)
            return
        group = mapped.get(shard)
        if group is None:
            mapped[shard] = group = set()
        group.add(tensor)
    for shard in sorted(set(mapped) - set(shard_paths)):
        count = len(mapped[shard])
        problems.append(FileProblem(INDEX, (
            f"{INDEX} maps {count} tensor{'s' * (count != 1)} to {shard}, which "
            f"{listed_by} does not hold: the engine would fail to load it; {REFETCH}")))
    for shard in sorted(set(shard_paths) - set(mapped)):
        problems.append(FileProblem(shard, (
            f"{shard} is not named by {INDEX}: the engine would never load its tensors; "
            f"fetch the index again or check the manifest")))
    for shard in sorted(set(mapped) & set(shard_paths)):
        header = headers.get(shard)
        if header is None or header.problems:
            continue
        absent = mapped[shard] - header.tensors
        if absent:
            problems.append(FileProblem(shard, (
                f"{INDEX} maps {len(absent)} tensor{'s' * (len(absent) != 1)} to {shard} "
                f"that its header does not hold ({_examples(absent)}): the shard or the index "
                f"is from another revision; {REFETCH}")))
        unmapped = header.tensors - mapped[shard]
        if unmapped:
            problems.append(FileProblem(shard, (
                f"{shard} holds {len(unmapped)} tensor{'s' * (len(unmapped) != 1)} that "
                f"{INDEX} does not map to it ({_examples(unmapped)}): the shard or the index "
                f"is from another revision; {REFETCH}")))
    metadata = body.get("metadata")
    total = metadata.get("total_size") if isinstance(metadata, dict) else None
    clean = [headers.get(s) for s in shard_paths]
    if isinstance(total, int) and all(h is not None and h.ok for h in clean):
        data_bytes = sum(h.data_bytes for h in clean if h is not None)
        if total != data_bytes:
            # Writers disagree on what total_size counts, and the engine does not read it.
            warnings.append(FileProblem(INDEX, (
                f"{INDEX} says total_size {total} but the shards hold {data_bytes} bytes of "
                "tensor data")))


def _examples(names: Collection[str]) -> str:
    shown = sorted(names)[:EXAMPLES]
    more = len(names) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more else "")


def _check_config(root: Path, problems: list[FileProblem]) -> None:
    try:
        body = json.loads((root / CONFIG).read_bytes())
    except (OSError, ValueError) as exc:
        problems.append(FileProblem(CONFIG, f"{CONFIG} is not valid JSON ({exc}): the engine "
                                            f"cannot read the model's geometry; {REFETCH}"))
        return
    if not isinstance(body, dict):
        problems.append(FileProblem(CONFIG, f"{CONFIG} is JSON but not an object; {REFETCH}"))
