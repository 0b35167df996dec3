"""Tuning per cell role: how many requests a box of each role holds at once, so what its
memory split is sized for (issue 17). Pure.

- **unified** (a box serving alone) and **decode**: every running request holds its state
  slots and KV for its whole context until it finishes. The split is sized for the profile's
  target concurrency, exactly as for a box serving alone.
- **prefill**: a request stays only while its prompt is computed and its KV handed to a
  decode box. SGLang prefills in batches of at most `--chunked-prefill-size` prompt tokens
  per forward (a longer prompt is cut into chunks and holds its slots until its last chunk),
  so a prefill batch holds `max(1, chunk // mean prompt)` requests. One batch is computed
  while the one before it is still handing its KV over, so the box holds
  `PREFILL_PIPELINE` batches: far fewer requests than a decode box. The split is sized for
  that many (with `--max-running-requests` set to it), and every byte it does not need for
  state goes to KV, where the prefix cache lives (a hit is a prompt not prefilled again).

Assumptions (what the prefill figure means): the prompt of a request is the profile's
length less its answer, split as a qualification splits a profile's lengths
(`appliance.qualify.plan.split_length`: a ninth is answer, at most 1,000 tokens); the mean
prompt sets the batch; prefix-cache hits (cached tokens are not in the chunk budget) and the
KV transfer's own queue are not modelled. The longest prompt must still fit in KV
(`recommend.capacity` checks it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from appliance.config import CELL_ROLES
from appliance.qualify.plan import PROFILE_SAMPLES, shapes_of
from appliance.tuning.profiles import LengthDistribution, format_tokens

ROLES = CELL_ROLES
# SGLang 0.5.23's --chunked-prefill-size on a GPU with 160 GiB or more (a B300):
# srt/arg_groups/memory_hook.py, _handle_gpu_memory_settings.
DEFAULT_CHUNKED_PREFILL = 16_384
PREFILL_PIPELINE = 2  # the batch being computed and the one whose KV is being handed over


@dataclass(frozen=True)
class RoleTarget:
    """What a role's split is sized for: `concurrency` requests at once, with
    `max_running_requests` (None: leave the flag as the launch has it) and the reason in words
    (`basis`)."""

    role: str
    concurrency: int
    max_running_requests: int | None
    basis: str

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def request_shape(lengths: LengthDistribution,
                  samples: int = PROFILE_SAMPLES) -> tuple[float, float]:
    """(mean prompt tokens, mean answer tokens) of a profile, from its lengths at evenly
    spaced percentiles, split as a qualification of that profile splits them."""
    shapes = shapes_of(lengths, samples)
    return (sum(s.input_tokens for s in shapes) / samples,
            sum(s.output_tokens for s in shapes) / samples)


def prefill_concurrency(lengths: LengthDistribution, chunked_prefill: int) -> int:
    """Requests a prefill box holds at once (module docstring): `PREFILL_PIPELINE` batches of
    `max(1, chunk // mean prompt)`."""
    prompt, _ = request_shape(lengths)
    return max(1, int(max(chunked_prefill, 1) // max(prompt, 1.0))) * PREFILL_PIPELINE


def role_target(role: str, lengths: LengthDistribution, target_concurrency: int, *,
                chunked_prefill: int | None = None) -> RoleTarget:
    """The sizing target of `role` for a profile (`chunked_prefill` None: SGLang's default on
    a B300, `DEFAULT_CHUNKED_PREFILL`)."""
    if role not in ROLES:
        raise ValueError(f"{role!r} is not a cell role (unified, prefill or decode)")
    if role == "unified":
        return RoleTarget(role, target_concurrency, None,
                          "a box serving alone holds every running request's state and KV "
                          f"until it finishes: sized for the profile's {target_concurrency} "
                          "concurrent requests")
    if role == "decode":
        return RoleTarget(role, target_concurrency, None,
                          "a decode box holds every running request's state and KV until it "
                          f"finishes: sized for the profile's {target_concurrency} concurrent "
                          "requests, as a box serving alone")
    chunk = chunked_prefill or DEFAULT_CHUNKED_PREFILL
    prompt, _ = request_shape(lengths)
    n = prefill_concurrency(lengths, chunk)
    chunk_from = ("--chunked-prefill-size" if chunked_prefill
                  else "SGLang's default --chunked-prefill-size on a B300")
    per_batch = n // PREFILL_PIPELINE
    batch = (f"{per_batch} prompts of a mean {format_tokens(prompt)} tokens fit in one batch"
             if per_batch > 1 else
             f"a mean prompt of {format_tokens(prompt)} tokens fills a batch on its own")
    return RoleTarget(role, n, n,
                      "a prefill box holds a request only while it computes its prompt and "
                      f"hands the KV to a decode box: {batch} of {format_tokens(chunk)} tokens "
                      f"({chunk_from}), and one batch is computed while the one before it "
                      f"hands its KV over, so it holds {n} at once, not the profile's "
                      f"{target_concurrency}; every byte not needed for their state goes to "
                      "KV, where the prefix cache lives")
