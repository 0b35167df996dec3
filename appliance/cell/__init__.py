"""The cell: several appliances working as one. One is the head (gateway and router); the
others are members it drives through their admin API with a credential scoped to cell work.

- `tokens`: the member's side of trust: one-time join tokens and the peer credentials they are
  exchanged for (both stored as keyed hashes only);
- `membership`: the head's registry of members and the credentials it holds for them;
- `peer`: the head's HTTP client to a member (timeouts, TLS, every call audited);
- `rows`: their tables (migration `0011_cell`).
"""
