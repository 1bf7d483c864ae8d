"""KV tiers below the engine's pool: host memory (G2), local disk (G3), peers (G4)."""
