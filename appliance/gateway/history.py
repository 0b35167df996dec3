"""Does a chat request append to a conversation this key sent before, or rewrite it?

Kimi K3 serves cheaply only when a client keeps a conversation append-only: the engine's radix
cache holds the prefix it has already computed, and the model reasons best over its own turns
as it wrote them (reasoning included). A rewritten earlier turn throws the cached prefix away
from that turn on. The gateway labels each chat request with `HistoryTracker.classify` and
counts the labels per key (`UsageRecord.history`, the roll-ups' `appended`/`rewritten`).

A conversation is seen only through its requests: message prefixes are compared by chained
fingerprints (`fingerprints`), never by content kept in memory. The rules, for a request whose
last assistant turn before its final message is turn `j` (its "history"):

- **new**: no assistant turn before the last message (a fresh conversation, or a one-shot).
- **appended**: the history through turn `j` is exactly what this key sent before, either
  (a) as a prefix of an earlier request (a follow-up, a retry, a regenerate, a branch from an
  earlier point with a new user turn: every kept turn is intact and still a cached prefix), or
  (b) as an earlier request, in full, followed by one new assistant turn: that request's reply,
  echoed back for the first time. A request sent k times (retries, regenerates) or asking for
  k choices accounts for k different replies; a further, different one is a rewrite.
- **rewritten**: not appended, but its first message is one this key began a request with (a
  system prompt, say): an earlier turn was edited, dropped, truncated or had its
  `reasoning_content` stripped, or a window slid past the oldest turns after the first.
- **unmatched**: history this tracker never saw: the conversation began before the gateway
  started (state is in memory only, so after a restart each conversation's next continuation
  is unmatched once, then appended), or elsewhere, or its records were evicted.

Why not "some earlier request is a prefix of this one": a conversation's first request is a
prefix of every later one, so any rewrite after the first turn would pass. Rule (b) asks for
the request the last assistant turn answered, and that turn to be its reply.

Precisely, a *regenerate* re-sends an earlier request unchanged after dropping the reply it
got: appended by rule (a) ("new" when it has no history), and the request then accounts for
one more reply, so continuing from either reply is appended too. Known limits: an assistant
turn the client alters the first time it echoes it back (say, always stripping reasoning) is
taken as the reply, since the gateway does not hash replies; a window that also drops the
first message shares no prefix and reads as unmatched; a conversation that starts with
history (few-shot turns) reads as rewritten or unmatched once. Keys never match each other.

Memory: per key an LRU of at most `max_fingerprints` full requests and as many prefixes (the
first message's and each assistant turn's), at most `max_keys` keys, least recently used
evicted first. A fingerprint costs about 150 bytes, so a key with both LRUs full at the 2048
default holds ~0.6 MiB, and the worst case is `max_keys` times that (about 600 MB at the
defaults, which a box with hundreds of busy keys could approach; real keys hold far fewer).
Not thread-safe: the gateway calls it on its event loop, and each
call is O(messages): about a millisecond for 200 messages and 200 KB on a slow core, a third
of it blake2b, so it stays on the loop.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from hashlib import blake2b
from typing import Any, Literal

History = Literal["new", "appended", "rewritten", "unmatched"]
DIGEST_BYTES = 8
DEFAULT_FINGERPRINTS = 2048
DEFAULT_KEYS = 1_000
# The parts of a message a chat template renders; anything else (an `index`, a client's own
# metadata) does not change the prompt.
PROMPT_PARTS = ("content", "name", "reasoning_content", "role", "tool_call_id", "tool_calls")
_CALL_KEYS = frozenset({"id", "type", "function"})
_FUNCTION_KEYS = frozenset({"name", "arguments"})
_PART_TAGS = tuple((name, f"\x00{name}=".encode()) for name in PROMPT_PARTS)


def canonical(message: object) -> bytes:
    """The bytes of a message that matter to the prompt: its `PROMPT_PARTS` in that order,
    each named, tagged with its type and length-prefixed (so no two messages share an
    encoding), keys sorted at every depth. A part that is absent, null, "" or [] is left out:
    clients echo an empty part either way, and a chat template renders none of them."""
    out: list[bytes] = []
    if not isinstance(message, dict | Mapping):
        _encode(message, out)  # not a message object: still hashed, deterministically
        return b"".join(out)
    for name, tag in _PART_TAGS:
        value = message.get(name)
        if value is None:
            continue
        if isinstance(value, str):  # inline: the common case, most of the bytes
            if value:
                out.append(tag)
                out.append(_string(value))
        elif value != []:
            out.append(tag)
            _encode(value, out)
    return b"".join(out)


def _encode(value: object, out: list[bytes]) -> None:
    # Hand-rolled rather than json.dumps: strings, most of a prompt's bytes, go through
    # str.encode at memory speed, where the JSON encoder escapes them character by character
    # (4x slower on a 200 KB conversation).
    if isinstance(value, str):
        out.append(_string(value))
    elif isinstance(value, list | tuple):  # before Mapping: an ABC check is slow
        out.append(b"l%d:" % len(value))
        for item in value:
            call = _tool_call(item)
            if call is None:
                _encode(item, out)
            else:
                out.append(call)
    elif isinstance(value, dict | Mapping):
        out.append(b"d%d:" % len(value))
        for key in sorted(value, key=str):
            out.append(_string(str(key)))
            item = value[key]
            if isinstance(item, str):
                out.append(_string(item))
            else:
                _encode(item, out)
    else:  # what else JSON parses to: numbers, booleans, null
        out.append(b"v%s;" % repr(value).encode())


def _tool_call(item: object) -> bytes | None:
    """A tool call of the usual shape, `{id, type, function: {name, arguments}}` with string
    leaves, encoded directly (a third of the generic cost; an agent's history is mostly these),
    or None for any other value. Its own tag keeps it apart from the generic encoding."""
    if type(item) is not dict or item.keys() != _CALL_KEYS:
        return None
    function, ident, kind = item["function"], item["id"], item["type"]
    if (type(function) is not dict or function.keys() != _FUNCTION_KEYS
            or type(ident) is not str or type(kind) is not str):
        return None
    name, arguments = function["name"], function["arguments"]
    if type(name) is not str or type(arguments) is not str:
        return None
    return b"c%s%s%s%s" % (_string(ident), _string(kind), _string(name), _string(arguments))


def _string(text: str) -> bytes:
    # surrogatepass: a lone surrogate escaped in the request's JSON is still one value.
    data = text.encode("utf-8", "surrogatepass")
    return b"s%d:%s" % (len(data), data)


def fingerprints(messages: Sequence[Mapping[str, Any]]) -> list[bytes]:
    """The fingerprint of each prefix: `h[i] = blake2b(h[i-1] + canonical(messages[i]))`,
    8 bytes, with `h[-1]` empty. Equal fingerprints at `i` mean equal prefixes through `i`
    (up to a 2**-64 collision); `h[0]` is the first message's alone."""
    chain: list[bytes] = []
    previous = b""
    for message in messages:
        previous = blake2b(previous + canonical(message), digest_size=DIGEST_BYTES).digest()
        chain.append(previous)
    return chain


def assistant_turns(messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """The indexes of the assistant messages, in order."""
    return [index for index, message in enumerate(messages)
            if isinstance(message, dict | Mapping) and message.get("role") == "assistant"]


@dataclass(slots=True)
class _KeyHistory:
    """One key's memory: full requests (with the replies they still account for) and the
    prefixes that rules (a) and "rewritten" look up, each an LRU (oldest first)."""

    requests: OrderedDict[bytes, int] = field(default_factory=OrderedDict)
    prefixes: OrderedDict[bytes, None] = field(default_factory=OrderedDict)


class HistoryTracker:
    """Labels chat requests per API key; see the module docstring for the rules and bounds."""

    def __init__(self, max_fingerprints: int = DEFAULT_FINGERPRINTS,
                 max_keys: int = DEFAULT_KEYS) -> None:
        if max_fingerprints < 1 or max_keys < 1:
            raise ValueError("the tracker needs room for at least one fingerprint and key")
        self.max_fingerprints = max_fingerprints
        self.max_keys = max_keys
        self._keys: OrderedDict[int, _KeyHistory] = OrderedDict()

    def classify(self, key_id: int, messages: Sequence[Mapping[str, Any]], *,
                 choices: int = 1) -> History:
        """Label this request against what `key_id` sent before, then remember it. `choices`
        is how many replies it asks for (the body's `n`)."""
        chain = fingerprints(messages)
        turns = assistant_turns(messages)
        history = [t for t in turns[-2:] if t < len(messages) - 1]  # before the last message
        state = self._state(key_id)
        label = self._judge(state, chain, history[-1] if history else None)
        self._remember(state, chain, turns, max(1, choices))
        return label

    def forget(self, key_id: int) -> None:
        """Drop a key's memory (a revoked or deleted key)."""
        self._keys.pop(key_id, None)

    def footprint(self) -> tuple[int, int]:
        """(keys tracked, fingerprints held): what the memory bound is about."""
        held = sum(len(s.requests) + len(s.prefixes) for s in self._keys.values())
        return len(self._keys), held

    # --- the rules -----------------------------------------------------------------------

    @staticmethod
    def _judge(state: _KeyHistory, chain: list[bytes], turn: int | None) -> History:
        """The label for a request whose last assistant turn before its end is `turn`; rule
        (b) claims one of the earlier request's replies."""
        if turn is None:
            return "new"
        if chain[turn] in state.prefixes:  # (a) this history, as sent before
            return "appended"
        if turn > 0:  # (b) an earlier request plus its reply, echoed for the first time
            asked = chain[turn - 1]
            open_replies = state.requests.get(asked, 0)
            if open_replies > 0:
                state.requests[asked] = open_replies - 1
                return "appended"
        return "rewritten" if chain[0] in state.prefixes else "unmatched"

    def _remember(self, state: _KeyHistory, chain: list[bytes], turns: list[int],
                  choices: int) -> None:
        if not chain:
            return
        limit = self.max_fingerprints
        requests, prefixes = state.requests, state.prefixes
        full = chain[-1]
        requests[full] = requests.get(full, 0) + choices
        requests.move_to_end(full)
        _touch(prefixes, chain[0])
        for index in turns:
            _touch(prefixes, chain[index])
        while len(requests) > limit:
            requests.popitem(last=False)
        while len(prefixes) > limit:
            prefixes.popitem(last=False)

    def _state(self, key_id: int) -> _KeyHistory:
        state = self._keys.get(key_id)
        if state is None:
            state = self._keys[key_id] = _KeyHistory()
            while len(self._keys) > self.max_keys:
                self._keys.popitem(last=False)
        else:
            self._keys.move_to_end(key_id)
        return state


def _touch(lru: OrderedDict[bytes, None], key: bytes) -> None:
    lru[key] = None
    lru.move_to_end(key)
