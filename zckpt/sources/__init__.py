"""Source shards of a MindSpore job: discovery, strategies, partial inputs, the direct reader, replica checks."""
