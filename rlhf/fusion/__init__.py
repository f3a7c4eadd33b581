"""Inter-stage fusion (generation -> inference, RLHFuse section 4.2).

`policy` (pure): when to migrate the long tail (threshold R, chosen by
simulating generation + inference), how many destinations (m) and which.
`transport`: moving one unfinished sample (`MigratedSequence`) between ranks
in a fixed, versioned message layout. `runtime`: the generation side at run
time (count unfinished samples every k steps, migrate once below R).
Inference on the freed ranks is not built yet. The engine stays unaware of
fusion: it only exports and imports sequences. See docs/fusion.md.
"""
