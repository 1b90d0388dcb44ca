"""verl-divclip test suite (a regular package: verl 0.9.1 ships a top-level `tests` package that would
shadow a namespace package of the same name)."""
