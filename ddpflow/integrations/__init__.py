"""Optional integrations, each imported only when a user calls it (the core never imports them)."""
