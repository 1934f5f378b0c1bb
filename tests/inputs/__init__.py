"""Bad input, one home: each case a user could type or hand over, refused where it enters with a message naming
the value and what is allowed, or handled without losing anything. A file per area: config, prompts and data,
rewards, run folder and resume, the command line."""
