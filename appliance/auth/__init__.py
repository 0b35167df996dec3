"""Admin access: accounts, sessions, API tokens, login throttling, the bootstrap credential."""
