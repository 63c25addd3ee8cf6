"""Tools a model calls: the call format, the tool definitions, how calls run."""
