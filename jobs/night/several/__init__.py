"""Several adapters in one night ([[adapters]]): one resident base model, each adapter's own state,
gate, versions and hot-swap; the window shared by a plan over all of them (docs/adapters.md)."""
