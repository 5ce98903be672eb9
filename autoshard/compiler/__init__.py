"""The compiler: trace → propagate → plan → partition → lower (one module each)."""
