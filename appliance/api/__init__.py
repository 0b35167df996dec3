"""The admin JSON API under /api/v1: thin controllers, typed structs at the edges."""
