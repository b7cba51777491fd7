"""The plan as data: which box of which source goes where, rank lists and strategy merging, from pure layout maths."""
