"""Training DFlash drafters (SPEC.md section 10) and the small target LMs they are tested on."""
