"""Conversation-history fingerprints: is a chat request an append to what its key sent before,
or a rewrite? Clients are played as they behave: each request is the previous one, plus the
reply, plus a new turn; the tricky cases change one thing about that."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from appliance.gateway.history import HistoryTracker, canonical, fingerprints

Message = dict[str, Any]
SYSTEM: Message = {"role": "system", "content": "You are Kimi, a helpful assistant."}


def user(text: str) -> Message:
    return {"role": "user", "content": text}


def assistant(text: str, reasoning: str | None = None, **parts: Any) -> Message:
    message: Message = {"role": "assistant", "content": text, **parts}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message


def call(ident: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": ident, "type": "function", "function": {"name": name, "arguments": arguments}}


def tool(ident: str, text: str) -> Message:
    return {"role": "tool", "tool_call_id": ident, "content": text}


def conversation(turns: int, tag: str = "", system: bool = True) -> list[list[Message]]:
    """The requests of an append-only chat of `turns` user turns: request i is request i-1,
    its reply, and the next question."""
    messages: list[Message] = [SYSTEM] if system else []
    requests = []
    for i in range(turns):
        if i:
            messages.append(assistant(f"answer {tag}{i}", reasoning=f"thinking {tag}{i}"))
        messages.append(user(f"question {tag}{i + 1}"))
        requests.append(list(messages))
    return requests


def labels(tracker: HistoryTracker, key: int, requests: list[list[Message]]) -> list[str]:
    return [tracker.classify(key, r) for r in requests]


# --- fingerprints ---------------------------------------------------------------------------


def test_fingerprints_chain_the_prefixes() -> None:
    full = conversation(4)[-1]
    chain = fingerprints(full)
    assert len(chain) == len(full) and all(len(h) == 8 for h in chain)
    assert len(set(chain)) == len(chain)
    for k in range(len(full) + 1):  # a prefix's chain is the chain's prefix
        assert fingerprints(full[:k]) == chain[:k]
    assert fingerprints([]) == []
    # The same messages in another order, or one changed, is another chain from there on.
    swapped = [full[0], full[2], full[1], *full[3:]]
    assert fingerprints(swapped)[0] == chain[0] and fingerprints(swapped)[1] != chain[1]
    edited = copy.deepcopy(full)
    edited[2]["content"] += "!"
    assert fingerprints(edited)[:2] == chain[:2]
    assert all(a != b for a, b in zip(fingerprints(edited)[2:], chain[2:], strict=True))


def test_only_what_the_prompt_renders_counts() -> None:
    base = assistant("", tool_calls=[call("c1", "grep", '{"q": "x"}')])
    same = [
        # Key order, at every depth, is the client's serialiser's business.
        {"tool_calls": [{"function": {"arguments": '{"q": "x"}', "name": "grep"},
                         "type": "function", "id": "c1"}], "content": "", "role": "assistant"},
        # Missing, null and "" are one thing; so are a missing and an empty list.
        {"role": "assistant", "content": None, "tool_calls": base["tool_calls"], "name": None},
        {"role": "assistant", "tool_calls": base["tool_calls"], "reasoning_content": None},
        # Parts a template never renders: the SDK's extras, a stream's index.
        {**base, "refusal": None, "audio": None, "function_call": None, "id": "msg_1"},
    ]
    for variant in same:
        assert canonical(variant) == canonical(base), variant
    different = [
        {**base, "reasoning_content": "because"},
        {**base, "name": "planner"},
        {**base, "tool_calls": [call("c2", "grep", '{"q": "x"}')]},
        {**base, "tool_calls": [call("c1", "grep", '{"q":"x"}')]},  # arguments are text
        {**base, "role": "user"},
        {**base, "content": " "},
    ]
    assert len({canonical(m) for m in different} | {canonical(base)}) == len(different) + 1
    # A string and the same text as a list of parts are different prompts to some templates.
    text = user("hello")
    parts = {"role": "user", "content": [{"type": "text", "text": "hello"}]}
    assert canonical(text) != canonical(parts)
    # Lengths are prefixed: moving a boundary between parts is a different message.
    assert canonical({"role": "user", "content": "ab", "name": "c"}) != canonical(
        {"role": "user", "content": "a", "name": "bc"})
    # Odd input still hashes deterministically (the gateway validates bodies elsewhere).
    odd = [{"role": "user", "content": [1, 2.5, True, None, {"b": "\ud800"}]}, "text"]
    assert fingerprints(odd) == fingerprints(copy.deepcopy(odd))


# --- classification --------------------------------------------------------------------------


def test_an_append_only_chat_and_a_tool_loop() -> None:
    tracker = HistoryTracker()
    assert labels(tracker, 1, conversation(5)) == ["new"] + ["appended"] * 4

    loop: list[Message] = [SYSTEM, user("fix the bug")]
    seen = [tracker.classify(2, list(loop))]
    for step in range(4):
        calls = [call(f"c{step}a", "read", f'{{"n": {step}}}'), call(f"c{step}b", "grep", "{}")]
        loop += [assistant("", f"step {step}", tool_calls=calls),
                 tool(f"c{step}a", "file text"), tool(f"c{step}b", "matches")]
        seen.append(tracker.classify(2, list(loop)))
    assert seen == ["new"] + ["appended"] * 4


def test_requests_without_history_are_new() -> None:
    tracker = HistoryTracker()
    assert tracker.classify(1, []) == "new"
    assert tracker.classify(1, [user("hi")]) == "new"
    assert tracker.classify(1, [SYSTEM, user("a"), user("b")]) == "new"
    # A trailing assistant message (a prefill to continue) is not history.
    assert tracker.classify(1, [SYSTEM, user("a"), assistant("Sure,")]) == "new"


def test_a_sliding_window_that_keeps_the_system_prompt_is_a_rewrite() -> None:
    tracker = HistoryTracker()
    requests = conversation(6)
    labels(tracker, 1, requests)
    window = [SYSTEM, *requests[-1][-5:]]  # the oldest turns dropped
    assert tracker.classify(1, window) == "rewritten"
    # The client goes on appending to its windowed history: appended from then on.
    assert tracker.classify(1, [*window, assistant("more"), user("next")]) == "appended"
    # Without a first message to share, a window reads as unmatched (a documented limit).
    other = HistoryTracker()
    bare = conversation(6, system=False)
    labels(other, 1, bare)
    assert other.classify(1, bare[-1][4:]) == "unmatched"


def test_an_edited_or_stripped_earlier_turn_is_a_rewrite() -> None:
    tracker = HistoryTracker()
    requests = conversation(4)
    assert labels(tracker, 1, requests)[-1] == "appended"
    latest = requests[-1]

    edited = copy.deepcopy(latest)
    edited[2]["content"] = "a shorter answer"  # the first reply, truncated
    assert tracker.classify(1, [*edited, assistant("x"), user("q")]) == "rewritten"

    stripped = copy.deepcopy(latest)
    for message in stripped:
        message.pop("reasoning_content", None)  # an earlier turn's thinking thrown away
    assert tracker.classify(1, [*stripped, assistant("y"), user("q")]) == "rewritten"

    # The latest reply edited before it is echoed: the request it answered already had its
    # one reply (in `latest`), so this is a second, different one.
    altered = [*requests[1], assistant("not what the model said"), user("q")]
    assert tracker.classify(1, altered) == "rewritten"
    # Dropping a turn in the middle.
    assert tracker.classify(1, [*latest[:2], *latest[4:]]) == "rewritten"


def test_regenerate_retry_and_several_choices_each_account_for_their_replies() -> None:
    tracker = HistoryTracker()
    first, second, _ = conversation(3)
    assert labels(tracker, 1, [first, second]) == ["new", "appended"]
    # Regenerate: `second` again, the reply it got dropped. Its history is intact.
    assert tracker.classify(1, second) == "appended"
    # Both replies to `second` continue cleanly; a third, never generated, is a rewrite.
    assert tracker.classify(1, [*second, assistant("reply A"), user("more")]) == "appended"
    assert tracker.classify(1, [*second, assistant("reply B"), user("more")]) == "appended"
    assert tracker.classify(1, [*second, assistant("reply C"), user("more")]) == "rewritten"
    # Regenerating the first turn has no history: new, and it accounts for one more reply.
    assert tracker.classify(1, first) == "new"
    assert tracker.classify(1, [*first, assistant("another first answer"),
                                user("go on")]) == "appended"

    # One request asking for n=2 choices; the client continues with each.
    ask = [SYSTEM, user("two ideas please")]
    assert tracker.classify(2, ask, choices=2) == "new"
    assert tracker.classify(2, [*ask, assistant("idea 1"), user("expand")]) == "appended"
    assert tracker.classify(2, [*ask, assistant("idea 2"), user("expand")]) == "appended"
    assert tracker.classify(2, [*ask, assistant("idea 3"), user("expand")]) == "rewritten"


def test_a_branch_with_a_new_user_turn_keeps_its_history_intact() -> None:
    """Editing the latest question (or forking an agent) keeps every earlier turn as the model
    wrote it: a cached prefix, so appended."""
    tracker = HistoryTracker()
    requests = conversation(3)
    labels(tracker, 1, requests)
    branch = [*requests[1][:-1], user("a better second question")]
    assert tracker.classify(1, branch) == "appended"
    fork = [*requests[2], assistant("answer 3"), user("plan B")]
    assert tracker.classify(1, [*requests[2], assistant("answer 3"), user("plan A")]) == (
        "appended")
    assert tracker.classify(1, fork) == "appended"


def test_interleaved_conversations_and_a_shared_system_prompt() -> None:
    tracker = HistoryTracker()
    chats = [conversation(4, tag=f"c{n}-") for n in range(5)]  # all share SYSTEM
    seen: list[list[str]] = [[] for _ in chats]
    for turn in range(4):
        for n, chat in enumerate(chats):
            seen[n].append(tracker.classify(7, chat[turn]))
    assert seen == [["new", "appended", "appended", "appended"]] * 5
    # Two conversations that began with the same question: each continuation is appended.
    twins = [SYSTEM, user("hi")]
    assert [tracker.classify(8, twins), tracker.classify(8, twins)] == ["new", "new"]
    assert tracker.classify(8, [*twins, assistant("Hello!"), user("x")]) == "appended"
    assert tracker.classify(8, [*twins, assistant("Hi there."), user("y")]) == "appended"


def test_keys_never_match_each_other() -> None:
    tracker = HistoryTracker()
    requests = conversation(3)
    labels(tracker, 1, requests)
    assert tracker.classify(2, requests[-1]) == "unmatched"  # same system prompt, other key
    assert tracker.classify(1, [*requests[-1], assistant("a"), user("b")]) == "appended"


def test_a_restart_forgets_so_the_next_continuation_is_unmatched_once() -> None:
    requests = conversation(5)
    before = HistoryTracker()
    labels(before, 1, requests[:3])
    after = HistoryTracker()  # the gateway restarted: state is in memory only
    assert labels(after, 1, requests[3:]) == ["unmatched", "appended"]


def test_memory_is_bounded_per_key_and_in_keys() -> None:
    tracker = HistoryTracker(max_fingerprints=8, max_keys=3)
    old = conversation(3, tag="old-")
    labels(tracker, 1, old)
    for n in range(20):  # many later conversations push the old one out
        labels(tracker, 1, conversation(3, tag=f"c{n}-"))
        keys, held = tracker.footprint()
        assert keys == 1 and held <= 2 * 8
    continuation = [*old[-1], assistant("late"), user("q")]
    assert tracker.classify(1, continuation) == "rewritten"  # the system prompt is still hot

    for key in (2, 3):
        labels(tracker, key, conversation(2))
    tracker.classify(1, [SYSTEM, user("touch key 1")])  # key 2 is now the least recent
    labels(tracker, 4, conversation(1))
    assert tracker.footprint()[0] == 3
    assert tracker.classify(2, conversation(2)[-1]) == "unmatched"  # evicted
    tracker.forget(4)  # key 4 sent [SYSTEM, question 1]: its continuation would be appended
    assert tracker.classify(4, conversation(2)[-1]) == "unmatched"
    with pytest.raises(ValueError, match="at least one"):
        HistoryTracker(max_fingerprints=0)
