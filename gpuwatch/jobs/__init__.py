"""Job trees: which launcher a process's job hangs from (tree), the members a poll reads under
each launcher (walker), a tree's identity (key) and what the history keeps of each tree over the
polls (records)."""
