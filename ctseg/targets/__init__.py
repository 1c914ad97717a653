"""`ctseg plan --target`: compiling ctseg's programs for GPUs and TPUs that are not here
(`catalogue` the targets, `process` and `child` the compile in a process of its own,
`compile` what is compiled and measured, `table` the shipped configs' table)."""
