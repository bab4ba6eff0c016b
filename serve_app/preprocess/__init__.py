"""The preprocessor: the plain ``Preprocessor`` (template, tokens, checks) and its deployment."""
