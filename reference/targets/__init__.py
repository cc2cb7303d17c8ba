"""numpy float64 references of the target families, one module each (tests compare with them)."""
