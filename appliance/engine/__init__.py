"""The engine: argv (pure), flag table, state machine (pure), log parser (pure), runners,
HTTP client, and the supervisor, the only writer of engine state. The daemon never imports
sglang."""
