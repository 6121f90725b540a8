"""HTTP layer: one module per route family, plus the app that assembles them."""
