"""The command line: the parser, its shared vocabulary, and the reference page rendered from it."""
