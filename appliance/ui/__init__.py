"""The admin console: thin HTML controllers over the runtime; templates live in web/."""
