"""Memory-pool tuning: model geometry, SGLang 0.5.23's state/KV sizing, budgets, profiles."""
