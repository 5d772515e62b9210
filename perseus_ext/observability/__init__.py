"""What a run shows of itself: the per-iteration records the runtime publishes, their JSONL log
(one row model for the writer and the reader), metrics for DeepSpeed's monitor, Megatron's
writers and Prometheus, the measured saving's statistics, the summary's text, `perseus-ext
report` and the figures.

Fed by typed views (`iteration.IterationRecord`, `feed.RankFeed`), never the runtime itself: the
room sits below `runtime/` in the import contract, so `perseus-ext report` reads logs without
loading the runtime.
"""
