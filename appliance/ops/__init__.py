"""Operating the appliance in a company: the support bundle (`bundle`, collected through the
one redaction table in `redact`), backup and restore."""
