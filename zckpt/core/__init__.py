"""The pure core: dtypes, layout maths, strategy values and the one exception hierarchy.

Imports nothing else of zckpt."""
