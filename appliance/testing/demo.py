"""`make demo`: the appliance as it exists today, on this machine, with a dev state dir.

A demo instrument, not production: it initialises `./.appliance/` (the `--dev` profile),
migrates the database, creates the bootstrap admin if there is none, prints how to log in
(including the one-time password, which production never prints), then runs `appliance serve`
in the foreground until Ctrl-C. Later issues add the engine emulator, weights and gateway
here, so `make demo` always shows everything that exists.
"""

from __future__ import annotations

import datetime as dt
import sys

from appliance.auth.bootstrap import bootstrap_file, ensure_first_admin
from appliance.cli import main as cli_main
from appliance.config import load_config
from appliance.db.database import Database
from appliance.errors import ApplianceError


def main() -> int:
    if cli_main(["--dev", "migrate"]) != 0:
        return 1
    try:
        config = load_config(dev=True)
    except ApplianceError as exc:
        print(f"demo: {exc.as_text()}", file=sys.stderr)
        return exc.exit_code
    db = Database(config.database_url)
    now = dt.datetime.now(dt.UTC)
    db.call(lambda s: ensure_first_admin(s, config.paths.state_dir, now))
    db.dispose()
    server = config.server
    credential = bootstrap_file(config.paths.state_dir)
    lines = [
        "",
        "  Kimi K3 appliance — demo (state in ./.appliance/; delete it to start over)",
        f"  Console:  http://{server.host}:{server.port}/",
        f"  API:      http://{server.host}:{server.port}/api/v1/schema/openapi.json",
    ]
    if credential.exists():
        lines += [
            "  Log in with the one-time credential (you will choose a new password):",
            *("      " + line for line in credential.read_text().splitlines()
              if not line.startswith("#")),
        ]
    else:
        lines.append("  Log in as the admin whose password you chose earlier "
                     "(forgot it? .venv/bin/appliance --dev admin reset-password --username admin)")
    lines += ["  Stop with Ctrl-C.", ""]
    print("\n".join(lines), flush=True)
    return cli_main(["--dev", "serve"])


if __name__ == "__main__":
    raise SystemExit(main())
